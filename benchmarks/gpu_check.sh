#!/usr/bin/env bash
# GPU check: the CUDA tests (tests/test_cuda.py, tests/test_ddp_async_cuda.py), the host time
# a hook adds to a step on the GPU (benchmarks/host_time.py --device cuda), then seconds per
# DDP training step (benchmarks/gpu_step.py).
#
#   bash benchmarks/gpu_check.sh [OUT_DIR] [extra gpu_step.py arguments...]
#   bash benchmarks/gpu_check.sh --dry-run          # what would run; works without a GPU
#
# Runs from a copy of the repository (nothing installed: PYTHONPATH=src). OUT_DIR defaults to
# $OUT when set, else benchmarks/results/. Writes there: pytest_cuda.txt (the tests' full
# report), host_time/host_time.{json,md} (host time per step), gpu_profile.txt (PowerSGD in one
# bucket against PyTorch's hook, by op), gpu_step.json and gpu_step.md (the step times).
# Finishes in about 10 minutes at most: the tests get at most TEST_TIMEOUT_S seconds (default
# 150), the host times HOST_TIMEOUT_S (default 100), the profile PROFILE_TIMEOUT_S (default
# 60), the step times --budget-s (default 300 here; no row runs past it). The step table is
# printed last.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-$(command -v python || command -v python3)}"

if [ "${1:-}" = "--dry-run" ]; then
    shift
    echo "would run: $PY -m pytest -q -rfEs tests/test_cuda.py tests/test_ddp_async_cuda.py" \
         "(timeout ${TEST_TIMEOUT_S:-150} s)"
    echo "would run: $PY -m benchmarks.host_time --device cuda --paths auto --rounds 5" \
         "(timeout ${HOST_TIMEOUT_S:-100} s)"
    echo "would run: $PY -m benchmarks.gpu_profile --configs torch-powersgd:rank=4" \
         "gradzip:powersgd:rank=4 --bucket-cap-mb 1024 (timeout ${PROFILE_TIMEOUT_S:-60} s)"
    exec "$PY" -m benchmarks.gpu_step --dry-run --budget-s "${BUDGET_S:-300}" "$@"
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
if "$PY" -c "import pytest" 2>/dev/null; then
    timeout -k 10 "${TEST_TIMEOUT_S:-150}" "$PY" -m pytest -q -rfEs -p no:cacheprovider --tb=short \
        tests/test_cuda.py tests/test_ddp_async_cuda.py >"$out/pytest_cuda.txt" 2>&1
    test_rc=$?
else
    # No pytest on this machine (and no network to get it): run the test functions with a
    # minimal stand-in for the three pytest features tests/test_cuda.py uses.
    timeout -k 10 "${TEST_TIMEOUT_S:-150}" "$PY" - >"$out/pytest_cuda.txt" 2>&1 <<'EOF'
import contextlib, importlib.util, itertools, re, sys, traceback, types

class _Mark:
    def skipif(self, cond, reason=""):
        return ("skip", cond, reason)

    def parametrize(self, names, values, ids=None):
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        def deco(fn):
            fn.__dict__.setdefault("_params", []).insert(0, (names, values))
            return fn
        return deco

@contextlib.contextmanager
def raises(kind, match=None):
    try:
        yield
    except kind as exc:
        assert match is None or re.search(match, str(exc)), f"{exc!r} does not match {match!r}"
    else:
        raise AssertionError(f"did not raise {kind.__name__}")

sys.modules["pytest"] = types.SimpleNamespace(mark=_Mark(), raises=raises)
spec = importlib.util.spec_from_file_location("test_cuda", "tests/test_cuda.py")
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
if getattr(mod, "pytestmark", (None, False))[1]:
    print("1 skipped: no CUDA device")
    sys.exit(0)
passed = failed = 0
for name, fn in list(vars(mod).items()):
    if not (name.startswith("test_") and callable(fn)):
        continue
    grids = getattr(fn, "_params", [])
    for combo in itertools.product(*[[(names, v) for v in values] for names, values in grids]):
        kwargs = {}
        for names, value in combo:
            kwargs.update(zip(names, value if len(names) > 1 else (value,)))
        label = f"{name}[{'-'.join(map(str, kwargs.values()))}]"
        try:
            fn(**kwargs)
            passed += 1
        except Exception:
            failed += 1
            print(f"FAILED {label}\n{traceback.format_exc(limit=-4)}")
print(f"{failed} failed, {passed} passed (without pytest)")
sys.exit(1 if failed else 0)
EOF
    test_rc=$?
fi
# The summary lines only (one per failure); the tracebacks stay in the file.
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|error" "$out/pytest_cuda.txt" | tail -n 40
echo "tests exit code: $test_rc"

echo "== host time per step on the GPU (tiny model: the GPU waits on the host)"
mkdir -p "$out/host_time"
timeout -k 10 "${HOST_TIMEOUT_S:-100}" "$PY" -m benchmarks.host_time --device cuda --paths auto \
    --rounds 5 --out "$out/host_time" 2>&1 | tail -n 45
host_rc=${PIPESTATUS[0]}
echo "host time exit code: $host_rc"

echo "== PowerSGD in one bucket against PyTorch's hook, profiled (gpu_profile.txt)"
timeout -k 10 "${PROFILE_TIMEOUT_S:-60}" "$PY" -m benchmarks.gpu_profile --out "$out" \
    --configs torch-powersgd:rank=4 gradzip:powersgd:rank=4 --bucket-cap-mb 1024 >/dev/null 2>&1
profile_rc=$?
grep -E "^(##|wall)" "$out/gpu_profile.txt" 2>/dev/null
echo "profile exit code: $profile_rc"

echo "== step times"
"$PY" -m benchmarks.gpu_step --out "$out" --budget-s "${BUDGET_S:-300}" "$@"
bench_rc=$?
echo "tests exit code: $test_rc, host time exit code: $host_rc, profile exit code: $profile_rc," \
     "step times exit code: $bench_rc"
exit $(( test_rc != 0 || host_rc != 0 || profile_rc != 0 || bench_rc != 0 ))
