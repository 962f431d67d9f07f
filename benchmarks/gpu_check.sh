#!/usr/bin/env bash
# GPU check: the CUDA tests, then seconds per DDP training step (benchmarks/gpu_step.py).
#
#   bash benchmarks/gpu_check.sh [OUT_DIR] [extra gpu_step.py arguments...]
#   bash benchmarks/gpu_check.sh --dry-run          # what would run; works without a GPU
#
# Runs from a copy of the repository (nothing installed: PYTHONPATH=src). OUT_DIR defaults to
# $OUT when set, else benchmarks/results/. Writes there: pytest_cuda.txt (the tests' full
# report), gpu_step.json and gpu_step.md (the step times). Finishes in under 8 minutes: the
# tests get at most TEST_TIMEOUT_S seconds (default 120), the step times --budget-s (default
# 300 here; no row runs past it). The step table is printed last.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"

if [ "${1:-}" = "--dry-run" ]; then
    shift
    echo "would run: $PY -m pytest -q -rfEs tests/test_cuda.py (timeout ${TEST_TIMEOUT_S:-120} s)"
    exec "$PY" benchmarks/gpu_step.py --dry-run --budget-s "${BUDGET_S:-300}" "$@"
fi

out="${OUT:-$PWD/benchmarks/results}"
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then out="$1"; shift; fi
mkdir -p "$out"

echo "== machine"
nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not available"
"$PY" - <<'EOF'
import platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, cuda {torch.version.cuda}, "
      f"GPUs {torch.cuda.device_count()}, NCCL {torch.cuda.nccl.version() if torch.cuda.is_available() else '-'}")
EOF

echo "== CUDA tests (full report in $out/pytest_cuda.txt)"
timeout -k 10 "${TEST_TIMEOUT_S:-120}" "$PY" -m pytest -q -rfEs -p no:cacheprovider --tb=short \
    tests/test_cuda.py >"$out/pytest_cuda.txt" 2>&1
test_rc=$?
# The summary lines only (one per failure); the tracebacks stay in the file.
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|error" "$out/pytest_cuda.txt" | tail -n 40
echo "tests exit code: $test_rc"

echo "== step times"
"$PY" benchmarks/gpu_step.py --out "$out" --budget-s "${BUDGET_S:-300}" "$@"
bench_rc=$?
echo "tests exit code: $test_rc, step times exit code: $bench_rc"
exit $(( test_rc != 0 || bench_rc != 0 ))
