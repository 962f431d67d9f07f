"""Hard threshold with a density budget: calibrated over a run, alone or as an Accordion level.

(That every rank of a real process group keeps the same lambda is checked with 4 gloo
processes in test_accordion_gloo.py.)
"""

from __future__ import annotations

import math

import pytest
import torch

from gradzip import Engine, HardThreshold, SimulatedGroup
from gradzip.control import Accordion

WORKERS = 4
SHAPES = {
    "conv.weight": torch.Size([32, 16, 3, 3]),
    "fc.weight": torch.Size([64, 32]),
    "fc.bias": torch.Size([64]),
}


def decaying_grads(step: int, decay: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """Per-worker gradients whose scale decays as ``exp(-step / decay)``, with a shared
    component (the signal) and a per-worker one (the noise), rows of unequal scale."""
    gen = torch.Generator().manual_seed(seed * 100_000 + step)
    scale = math.exp(-step / decay)
    out = {}
    for name, shape in SHAPES.items():
        rows = torch.linspace(0.5, 2.0, shape[0]).reshape(-1, *([1] * (len(shape) - 1)))
        signal = torch.randn(1, *shape, generator=gen)
        noise = torch.randn(WORKERS, *shape, generator=gen)
        out[name] = scale * rows * (0.5 * signal + noise)
    return out


def density(state: dict) -> float:
    """Entries sent by all workers over entries offered, over the whole run."""
    return state["sent"] / state["offered"]


@pytest.mark.slow
@pytest.mark.parametrize(("budget", "decay"), [(0.01, 100.0), (0.05, 60.0)])
def test_run_density_meets_the_budget_and_lambda_follows_the_scale(budget: float, decay: float) -> None:
    engine = Engine(SHAPES, f"threshold:budget={budget}", collective=SimulatedGroup(WORKERS))
    lams, steps = [], []
    for step in range(300):
        before = engine.compressor_state["sent"], engine.compressor_state["offered"]
        engine.reduce(decaying_grads(step, decay))
        state = engine.compressor_state
        lams.append(state["lam"])  # one lambda for every worker: a single float in the state
        steps.append((state["sent"] - before[0]) / (state["offered"] - before[1]))
    assert density(state) == pytest.approx(budget, rel=0.10)
    # Calibrated, not frozen: lambda tracks the gradient scale down (by e^-3 and e^-5 here).
    assert lams[-1] < 0.25 * max(lams)
    # And no limit cycle: late steps send about the budget, not "nothing" then "a flood".
    late = steps[200:]
    assert min(late) > 0.3 * budget and max(late) < 3 * budget
    assert engine.stats["payload_bytes"][0] < 0.2 * engine.stats["dense_payload_bytes"][0]


def test_budget_run_resumes_bit_exactly() -> None:
    def engine() -> Engine:
        return Engine(SHAPES, "threshold:budget=0.02", collective=SimulatedGroup(WORKERS))

    straight = engine()
    for step in range(40):
        straight.reduce(decaying_grads(step, 50.0))
    first = engine()
    for step in range(17):
        first.reduce(decaying_grads(step, 50.0))
    resumed = engine()
    resumed.load_state_dict(first.state_dict())
    for step in range(17, 40):
        resumed.reduce(decaying_grads(step, 50.0))
    assert resumed.compressor_state == straight.compressor_state  # plain floats and ints


@pytest.mark.slow
@pytest.mark.parametrize(
    ("steady", "critical", "steps"),
    [
        ("threshold:budget=0.01", "threshold:budget=0.1", 300),
        ("threshold:budget=0.01", "none", 150),
    ],
)
def test_budget_levels_under_accordion_each_meet_their_budget(steady: str, critical: str, steps: int) -> None:
    acc = Accordion(steady, critical, interval=20)
    engine = Engine(SHAPES, acc, collective=SimulatedGroup(WORKERS))
    for step in range(steps):
        engine.reduce(decaying_grads(step, 100.0))
    counts = Accordion.counts(engine)
    assert counts["steady_steps"] > 0 and counts["critical_steps"] > 0
    state = engine.compressor_state
    for key in ("steady", "critical"):
        level = getattr(acc, key)
        if isinstance(level, HardThreshold):
            # Each level meets its own budget over the steps it was in charge of, although
            # it sat idle (lambda frozen) while the other level ran.
            assert density(state[key]) == pytest.approx(level.budget, rel=0.15), key


@pytest.mark.slow
@pytest.mark.parametrize("levels", [
    ("threshold:lam=3.0", "threshold:lam=1.0"),
    # With a capacity, a message's size is its capacity: the critical level's is larger.
    ("threshold:lam=3.0,capacity=0.02", "threshold:lam=1.0,capacity=0.1"),
])
def test_fixed_threshold_levels_under_accordion(levels: tuple[str, str]) -> None:
    acc = Accordion(*levels, interval=10)
    engine = Engine(SHAPES, acc, collective=SimulatedGroup(WORKERS))
    alone = {key: Engine(SHAPES, getattr(acc, key), collective=SimulatedGroup(WORKERS))
             for key in ("steady", "critical")}
    for step in range(120):
        grads = decaying_grads(step, 100.0)
        for each in (engine, *alone.values()):
            each.reduce(grads)
    counts = Accordion.counts(engine)
    assert counts["steady_steps"] > 0 and counts["critical_steps"] > 0
    assert engine.compressor_state["steady"]["lam"] == 3.0  # the paper's constant lambda
    # Both levels ran, so the bytes fall between what each level alone sends.
    sent = engine.stats["payload_bytes"][0]
    assert alone["steady"].stats["payload_bytes"][0] < sent < alone["critical"].stats["payload_bytes"][0]


def test_padded_budget_bounds_the_wire_volume_like_topk() -> None:
    """With uneven workers, a padded budget ships about what Top-k of the same ratio ships
    (both all-gathered: the sharded exchange's sizes do not follow the workers' counts)."""
    shapes = {"w": torch.Size([4000])}
    gen = torch.Generator().manual_seed(5)
    spread = torch.tensor([0.5, 1.0, 2.0, 4.0]).unsqueeze(1)  # workers of very different scale
    engines = {
        spec: Engine(shapes, spec, collective=SimulatedGroup(4))
        for spec in ("threshold:budget=0.01,exchange=allgather", "threshold:budget=0.01,padded=true",
                     "topk:ratio=0.01,exchange=allgather")
    }
    for _ in range(300):
        grads = {"w": torch.randn(4, 4000, generator=gen) * spread}
        for engine in engines.values():
            engine.reduce(grads)
    wire = {spec: e.stats["wire_bytes"][0] for spec, e in engines.items()}
    topk = wire["topk:ratio=0.01,exchange=allgather"]
    assert wire["threshold:budget=0.01,exchange=allgather"] > 1.5 * topk  # padding to the densest worker costs
    assert 0.85 * topk < wire["threshold:budget=0.01,padded=true"] < 1.15 * topk
    with pytest.raises(ValueError, match="`padded` needs `budget`"):
        HardThreshold(lam=0.1, padded=True)
