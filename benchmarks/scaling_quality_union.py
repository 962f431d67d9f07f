"""``gradzip train`` with Top-k all-gathered at every size and ``W``: the union of every worker's
selection, even where the engine would send the tensor dense because that costs fewer bytes.

    python -m benchmarks.scaling_quality_union train ... --compressor topk:ratio=0.1,exchange=allgather

At 16 workers Top-k 10%'s all-gather costs more than a dense ring, so ``exchange=allgather``
sends every tensor dense and trains as ``none``: it is then no reference for the sharded form
at the same density. This entry point replaces ``TopK.exchange_for`` for the process it
runs in (nothing else changes), so the comparison of BENCHMARKS section 6 can be made with the
same selection on both sides.
"""

from __future__ import annotations

import sys

from gradzip.cli import main
from gradzip.compressors.topk import TopK


def _always_gathered(self: TopK, numel: int, world: int) -> str:
    return "allgather"


if __name__ == "__main__":
    TopK.exchange_for = _always_gathered  # type: ignore[method-assign]
    raise SystemExit(main(sys.argv[1:]))
