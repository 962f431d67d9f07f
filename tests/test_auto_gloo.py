"""``auto`` in 2 real gloo processes whose clocks disagree: every rank decides alike."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradzip import Auto, Engine, SimulatedGroup
from gradzip.comm import run_processes
from test_auto import SHAPES, LinkClock, grads

WORLD = 2
STEPS = 70
SCALES = (1.0, 1.5)  # rank 1's clock runs 1.5x as fast as rank 0's


def run(rank: int | None, scale: float) -> dict[str, Any]:
    """Drive one engine; ``rank=None`` simulates both workers in one process."""
    clock = LinkClock(10, 1e-3, scale=scale)
    collective = SimulatedGroup(WORLD) if rank is None else None  # None: the world group
    # A small probe message, so that it grows; its first growth (1536 to 6144 bytes) costs
    # 3.7 ms on rank 0's clock, under the 5 ms that stops the growth, and 5.5 ms on rank 1's:
    # alone they would part ways, and the maxima over the ranks keep their calls paired.
    engine = Engine(SHAPES, Auto(clock=clock, every=20, probe_bytes=1536), collective=collective)
    clock.group = engine.comm
    out: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        clock.compute += 0.02
        g = grads(step, workers=WORLD)
        out = engine.reduce(g if rank is None else {n: t[rank] for n, t in g.items()})
    records = Auto.decisions(engine, since=0)
    return {"choices": [(r["step"], r["level"], r["critical"]) for r in records],
            "records": records, "out": out}


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return run(rank, SCALES[rank])


@pytest.mark.slow
def test_ranks_with_different_clocks_decide_alike() -> None:
    ranks = run_processes(_worker, WORLD, timeout=240)
    # Bit-identical records on both ranks: decisions read maxima over the ranks only.
    assert ranks[1]["records"] == ranks[0]["records"]
    for name in SHAPES:
        assert torch.equal(ranks[0]["out"][name], ranks[1]["out"][name])
    # The maxima are the faster-running clock's: the simulator driven by that clock decides
    # the same levels.
    assert ranks[0]["choices"] == run(None, max(SCALES))["choices"]
    assert [c[1] for c in ranks[0]["choices"]][:2] == ["powersgd-r4", "topk-1%"]


def _ddp_worker(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    from ddp_helpers import TINY_BUCKET_MB, train_ddp
    result = {}
    for mode, kwargs in (("async", {}), ("sync", {"overlap": False})):
        got = train_ddp(rank, spec="auto(every=2,warmup=1)", steps=7,
                        bucket_cap_mb=TINY_BUCKET_MB, hook_kwargs=kwargs)
        engine = got["state"]
        records = Auto.decisions(engine.engine, since=0)
        result[mode] = {"identical": got["identical"], "params": got["params"],
                        "choices": [(r["step"], r["level"], r["critical"]) for r in records],
                        "decisions": Auto.counts(engine.engine)["decisions"]}
    return result


@pytest.mark.slow
def test_ddp_hook_ranks_decide_alike_with_real_clocks(tmp_path: Any) -> None:
    # Real time here: which levels are chosen may vary from run to run; that every rank
    # chooses the same, and that replicas stay identical, may not.
    from ddp_helpers import spawn
    ranks = spawn(_ddp_worker, WORLD, tmp_path)
    for mode in ("async", "sync"):
        a, b = ranks[0][mode], ranks[1][mode]
        assert all(a["identical"]) and all(b["identical"])
        assert a["choices"] == b["choices"] and a["decisions"] == 3  # at steps 1, 3 and 5
        assert torch.equal(a["params"], b["params"])
