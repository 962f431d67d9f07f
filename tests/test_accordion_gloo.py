"""Accordion in 4 real gloo processes: every rank takes the same decisions, the simulator's."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shared_launch
from gradzip import Engine, SimulatedGroup, compressor_from_spec
from gradzip.control import Accordion
from test_accordion_state import scaled_grads as grads_for

WORLD = 4
STEPS = 16
LR_DROP_STEP = 9
SCENARIOS = {
    "powersgd": "accordion(steady=powersgd:rank=1,critical=powersgd:rank=4,eta=0.5,interval=2)",
    "topk-model": "accordion(steady=topk:ratio=0.02,critical=topk:ratio=0.2,interval=2,per_layer=False)",
    "threshold": "accordion(steady=threshold:budget=0.01,critical=threshold:budget=0.1,interval=2)",
    "threshold-alone": "threshold:budget=0.02",
}


SHAPES = {n: g.shape[1:] for n, g in grads_for(0, 1).items()}


def build(spec: str) -> Any:
    return Accordion.parse(spec) if spec.startswith("accordion") else compressor_from_spec(spec)


def lambdas(state: dict[str, Any]) -> list[float]:
    """Every hard-threshold lambda in a compressor state (none for other compressors)."""
    if "lam" in state:
        return [state["lam"]]
    return [state[k]["lam"] for k in ("steady", "critical") if "lam" in state.get(k, {})]


def run(spec: str, rank: int | None) -> dict[str, Any]:
    """Drive one engine for STEPS steps; ``rank=None`` simulates all workers in one process."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)  # holds the LR
    collective = SimulatedGroup(WORLD) if rank is None else None  # None: the world group
    engine = Engine(SHAPES, build(spec), collective=collective, optimizer=opt)
    history: dict[str, list[Any]] = {"levels": [], "decisions": [], "lam": []}
    out: dict[str, torch.Tensor] = {}
    for step in range(STEPS):
        if step == LR_DROP_STEP:
            opt.param_groups[0]["lr"] = 0.01
        grads = grads_for(step, WORLD)
        if rank is not None:
            grads = {n: g[rank] for n, g in grads.items()}
        seen = Accordion.counts(engine)["decisions"] if isinstance(engine.compressor, Accordion) else 0
        out = engine.reduce(grads)
        if isinstance(engine.compressor, Accordion):
            history["levels"].append(Accordion.levels(engine))
            history["decisions"].append(Accordion.decisions(engine, since=seen))
        history["lam"].append(lambdas(engine.compressor_state))
    history["out"] = out
    history["payload"] = engine.stats["payload_bytes"]  # one entry per local worker
    return history


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {name: run(spec, rank) for name, spec in SCENARIOS.items()}


shared_launch.register(WORLD, "accordion_gloo", _worker)


@pytest.mark.slow
def test_every_rank_decides_alike_and_like_the_simulator(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    # Launched with the other modules' workers of this world size (see shared_launch).
    per_rank = shared_launch.results(WORLD, "accordion_gloo", tmp_path_factory)
    for name, spec in SCENARIOS.items():
        sim = run(spec, None)
        ranks = [got[name] for got in per_rank]
        for rank, real in enumerate(ranks[1:], start=1):
            # Bit-identical on every rank: decisions come from aggregated values only.
            assert real["levels"] == ranks[0]["levels"], (name, rank)
            assert real["decisions"] == ranks[0]["decisions"], (name, rank)
            assert real["lam"] == ranks[0]["lam"], (name, rank)
            for tensor in SHAPES:
                assert torch.equal(real["out"][tensor], ranks[0]["out"][tensor]), (name, tensor)
        real = ranks[0]
        # The simulator sums in another order: the same decisions, norms to rounding.
        assert real["levels"] == sim["levels"], name
        for got, want in zip(real["decisions"], sim["decisions"], strict=True):
            assert [(r["name"], r["level"], r["reason"], r["step"]) for r in got] == [
                (r["name"], r["level"], r["reason"], r["step"]) for r in want
            ], name
            for a, b in zip(got, want, strict=True):
                assert (a["norm"] is None) == (b["norm"] is None)
                if a["norm"] is not None:
                    assert a["norm"] == pytest.approx(b["norm"], rel=1e-5)
        flat = [lam for step in real["lam"] for lam in step]
        assert flat == pytest.approx([lam for step in sim["lam"] for lam in step], rel=1e-4), name
        # Bytes follow from the decisions and message sizes: the simulator's, worker by worker.
        assert [got[name]["payload"][0] for got in per_rank] == sim["payload"], name
    # The scenarios exercise what they claim: switches, an LR drop, calibrated lambdas.
    powersgd = per_rank[0]["powersgd"]["levels"]
    assert {lv["fc.weight"] for lv in powersgd} == {"critical", "steady"}
    reasons = {r["reason"] for d in per_rank[0]["powersgd"]["decisions"] for r in d}
    assert {"first", "lr_drop", "steady", "norm_change"} <= reasons
    assert all(len(lams) == 2 for lams in per_rank[0]["threshold"]["lam"])
    assert per_rank[0]["threshold-alone"]["lam"][-1][0] > 0
