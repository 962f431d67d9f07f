"""Kernel benchmark (BENCHMARKS.md section 1): ``gradzip bench micro`` and the project's targets.

    python -m benchmarks.micro [--json] [--numel N ...] [--repeat R] [--threads T]
                               [--heap warm|default] [--compressors SPEC ...]

It takes the options of ``gradzip bench micro`` and prints the same table, followed by one
verdict per kernel target and tensor size (from 1M entries): met or MISSED, with the ratio.
With ``--json`` it prints the rows only, as ``gradzip bench micro --json`` does. With Numba
installed (the ``fast`` extra) the threshold and QSGD rows time the compiled kernels; run it
again with ``GRADZIP_JIT=0`` in the environment to time the NumPy and torch fallback.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from gradzip.bench import MicroRow, main

#: Hard threshold: compress at most this many times ``tensor.clone()`` of the same tensor.
THRESHOLD_MAX_OVER_CLONE = 2.0
#: Exact Top-k: compress at least this many times faster than ``torch.topk`` of the magnitudes.
TOPK_MIN_SPEEDUP = 3.0
#: PowerSGD: compress no slower than the arithmetic of PyTorch's built-in ``powerSGD_hook``.
POWERSGD_MIN_SPEEDUP = 1.0
#: QSGD and Sign: decoding and averaging four workers' messages under this many clones.
DECODE_MAX_OVER_CLONE = 8.0
#: The kernel targets are stated for tensors of 1M entries and more.
TARGET_MIN_NUMEL = 1_000_000


def micro_verdicts(rows: Sequence[MicroRow]) -> list[str]:
    """One line per kernel target and size (from 1M entries): met or missed, with the ratio.

    Args:
        rows: what ``gradzip.bench.run_micro`` returned.

    Returns:
        The verdict lines, in the rows' order; none for a row without a target.
    """
    lines = []
    for row in rows:
        if row.numel < TARGET_MIN_NUMEL:
            continue
        d = row.as_dict()
        if row.compressor.startswith("threshold"):
            ratio = d["compress_over_clone"]
            ok = ratio <= THRESHOLD_MAX_OVER_CLONE
            lines.append(f"threshold compress <= {THRESHOLD_MAX_OVER_CLONE:g}x clone at "
                         f"{row.numel}: {'met' if ok else 'MISSED'} ({ratio:.2f}x)")
        elif row.compressor.split(":")[0] in ("qsgd", "sign"):
            ratio = row.decode_seconds / row.clone_seconds
            ok = ratio < DECODE_MAX_OVER_CLONE
            lines.append(f"{row.compressor.split(':')[0]} decode < {DECODE_MAX_OVER_CLONE:g}x clone at "
                         f"{row.numel}: {'met' if ok else 'MISSED'} ({ratio:.2f}x, {row.kernels} kernels)")
        elif row.compressor.startswith("topk") and d["baseline_over_compress"] is not None:
            ratio = d["baseline_over_compress"]
            ok = ratio >= TOPK_MIN_SPEEDUP
            sel = row.baseline_seconds / row.select_seconds if row.select_seconds else None
            extra = f"; select op alone {sel:.2f}x" if sel is not None else ""
            lines.append(f"topk compress >= {TOPK_MIN_SPEEDUP:g}x faster than torch.topk at "
                         f"{row.numel}: {'met' if ok else 'MISSED'} ({ratio:.2f}x{extra})")
        elif row.compressor.startswith("powersgd") and d["baseline_over_compress"] is not None:
            ratio = d["baseline_over_compress"]
            ok = ratio >= POWERSGD_MIN_SPEEDUP
            lines.append(f"powersgd compress no slower than the built-in's math at {row.numel}: "
                         f"{'met' if ok else 'MISSED'} (built-in / gradzip = {ratio:.2f})")
    return lines


def run(argv: Sequence[str]) -> int:
    """``gradzip bench micro`` with ``argv``, verdicts below the table; returns the exit status."""
    return main(["micro", *argv], notes=micro_verdicts)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
