"""DDP hook benchmark over gloo (BENCHMARKS.md section 2): ``gradzip bench hooks`` and the
project's targets.

    python -m benchmarks.hooks [--json] [--workers 2 4] [--steps N] [--rounds R]
                               [--configs CFG ...]

It takes the options of ``gradzip bench hooks`` and prints the same table, followed by one
verdict per step-time target and world size: met or MISSED, with the ratio. With ``--json`` it
prints the rows only, as ``gradzip bench hooks --json`` does.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from gradzip.bench import HookRow, main

#: ``gradzip:none`` at most this many times plain DDP's step time (within 5%).
NONE_MAX_OVERHEAD = 1.05
#: ``gradzip:powersgd`` at most this many times the built-in ``powerSGD_hook``'s step time
#: (both taken relative to plain DDP in the same rounds).
POWERSGD_MAX_OVER_BUILTIN = 1.0


def hook_verdicts(rows: Sequence[HookRow]) -> list[str]:
    """One line per DDP target and world size: met or missed, with the measured ratio.

    Args:
        rows: what ``gradzip.bench.run_hooks`` returned.

    Returns:
        The verdict lines, by world size; a target whose configurations were not run has none.
    """
    lines = []
    by_key = {(r.workers, r.config): r for r in rows}
    for world in sorted({r.workers for r in rows}):
        none = by_key.get((world, "gradzip:none"))
        if none is not None and none.ratio_to_nohook is not None:
            ok = none.ratio_to_nohook <= NONE_MAX_OVERHEAD
            lines.append(f"gradzip none within 5% of no hook, {world} workers: "
                         f"{'met' if ok else 'MISSED'} ({none.ratio_to_nohook:.3f}x; CPU time "
                         f"{none.cpu_ratio_to_nohook:.3f}x)")
        ours = next((r for (w, c), r in by_key.items()
                     if w == world and c.startswith("gradzip:powersgd")), None)
        theirs = next((r for (w, c), r in by_key.items()
                       if w == world and c.startswith("builtin-powersgd")), None)
        if ours is not None and theirs is not None and ours.ratio_to_nohook and theirs.ratio_to_nohook:
            ratio = ours.ratio_to_nohook / theirs.ratio_to_nohook
            cpu = (ours.cpu_ratio_to_nohook or 0) / (theirs.cpu_ratio_to_nohook or 1)
            ok = ratio <= POWERSGD_MAX_OVER_BUILTIN
            lines.append(f"gradzip powersgd no slower than the built-in hook, {world} workers: "
                         f"{'met' if ok else 'MISSED'} (gradzip / built-in = {ratio:.3f}; "
                         f"CPU time {cpu:.3f})")
    return lines


def run(argv: Sequence[str]) -> int:
    """``gradzip bench hooks`` with ``argv``, verdicts below the table; returns the exit status."""
    return main(["hooks", *argv], notes=hook_verdicts)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
