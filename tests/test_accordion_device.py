"""Accordion on the device decision path: what changes every step is tensors, so steady steps
read nothing on the host, and the decisions, averages, residuals and state are bit for bit
the host path's, through skipped steps, dropped calls, learning-rate changes and drops;
checkpoints of the earlier state layout still load and resume exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import gradzip
from conformance import SHAPES, make_grads
from gradzip.comm.simulated import SimulatedGroup, SingleWorker
from gradzip.control import Accordion
from test_host_syncs import _host_reads

NAMES = list(SHAPES)
LEVELS = "steady=powersgd:rank=1,critical=powersgd:rank=4"
SPECS = [
    f"accordion({LEVELS},interval=3)",
    f"accordion({LEVELS},interval=3,window=3,lr_hold=boundary)",
    f"accordion({LEVELS},interval=2,signal=sent,per_layer=False)",
    "accordion(steady=topk:ratio=0.05,critical=topk:ratio=0.3,interval=3)",
]
FIXTURE = Path(__file__).parent / "data" / "accordion_state_v1.pt"


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [x for key in sorted(tree) for x in _leaves(tree[key])]
    if isinstance(tree, list):
        return [x for item in tree for x in _leaves(item)]
    return [tree]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and torch.equal(a.isnan(), b.isnan())
                and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)))
    return a == b


def _train(spec: str, policy: str, workers: int, on_device: bool, same_layout: bool) -> Any:
    group = SingleWorker() if workers == 1 else SimulatedGroup(workers)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    engine = gradzip.Engine(SHAPES, spec, collective=group, nonfinite=policy, optimizer=opt,
                            decide_on="device" if on_device else "host")
    results, device_steps = [], 0
    for step in range(16):
        if step == 6:
            opt.param_groups[0]["lr"] = 0.095  # a smooth schedule's step: not a drop
        if step == 9:
            opt.param_groups[0]["lr"] = 0.0095  # a drop
        grads = make_grads(workers, step)
        if workers == 1:
            grads = {n: g[0] for n, g in grads.items()}
        if step in (4, 10):  # a NaN in the step's second call (4: a decision falls due)
            grads["fc.weight"].view(-1)[5] = float("nan")
        if step == 7:  # NaN in the first call
            grads["conv.weight"].view(-1)[2] = float("inf")
        for i, part in enumerate([NAMES[:2], NAMES[2:]]):
            results.append(engine.reduce({n: grads[n] for n in part}, finish_step=i == 1,
                                         same_layout=same_layout))
        # A step that ended on the device leaves its skipped-step count there.
        device_steps += engine._skips.pending is not None
        engine._skips.read()
    return results, engine, device_steps


@pytest.mark.parametrize(("policy", "workers", "same_layout"), [
    ("skip", 1, False), ("zero", 3, False), ("skip", 3, True), ("zero", 1, True)])
@pytest.mark.parametrize("spec", SPECS)
def test_device_path_equals_host_path(spec: str, policy: str, workers: int,
                                      same_layout: bool) -> None:
    host, host_engine, host_device_steps = _train(spec, policy, workers, False, same_layout)
    dev, dev_engine, dev_device_steps = _train(spec, policy, workers, True, same_layout)
    assert host_device_steps == 0 and dev_device_steps >= 3  # the device path was taken
    for a, b in zip(host, dev, strict=True):
        assert a.keys() == b.keys() and all(_same(a[n], b[n]) for n in a)
    hs, ds = host_engine.state_dict(), dev_engine.state_dict()
    assert hs["skipped_steps"] == ds["skipped_steps"] >= (2 if policy == "skip" else 0)
    for name, rest in hs["residuals"].items():
        assert torch.equal(rest, ds["residuals"][name]), name
    host_leaves, dev_leaves = _leaves(hs["compressor_state"]), _leaves(ds["compressor_state"])
    assert len(host_leaves) == len(dev_leaves)
    assert all(_same(a, b) for a, b in zip(host_leaves, dev_leaves, strict=True))
    assert Accordion.decisions(host_engine, since=0) == Accordion.decisions(dev_engine, since=0)
    assert Accordion.counts(host_engine) == Accordion.counts(dev_engine)
    assert Accordion.counts(dev_engine)["reasons"]["lr_drop"] > 0


def _reads_per_step(engine: gradzip.Engine, steps: range, monkeypatch: pytest.MonkeyPatch,
                    opt: torch.optim.Optimizer | None = None) -> list[tuple[int, int]]:
    """Per step: (host reads the profiler sees, ``tolist`` calls: a read it does not see);
    with ``opt``, its learning rate lowered by 1% before every step (a smooth schedule)."""
    lists = [0]
    tolist = torch.Tensor.tolist

    def counted(self: torch.Tensor) -> Any:
        lists[0] += 1
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    reads = []
    for step in steps:
        grads = make_grads(2, step)
        if opt is not None:
            opt.param_groups[0]["lr"] *= 0.99
        lists[0] = 0
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            engine.reduce({n: grads[n] for n in NAMES[:2]}, finish_step=False)
            engine.reduce({n: grads[n] for n in NAMES[2:]})
        reads.append((len(_host_reads(prof.events())), lists[0]))
    return reads


@pytest.mark.parametrize("schedule", [False, True])
def test_steady_steps_read_nothing_and_decision_steps_once(
        monkeypatch: pytest.MonkeyPatch, schedule: bool) -> None:
    # With a learning rate that changes every step (no drop), the rate is kept as the step
    # begins, so the step's calls still decide on the device.
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1) if schedule else None
    engine = gradzip.Engine(SHAPES, f"accordion({LEVELS},interval=5)",
                            collective=SimulatedGroup(2), decide_on="device", optimizer=opt)
    reads = _reads_per_step(engine, range(14), monkeypatch, opt)
    # The first step has no window sums yet (made on the host). Decisions fall due after
    # steps 1, 6 and 11 (window 1) and are taken as the next step begins, before its first
    # call: one read (the norms), and the step's calls stay on the device.
    assert reads[0][0] > 0
    assert [reads[i] for i in (1, 6, 11)] == [(0, 1)] * 3
    assert [r for i, r in enumerate(reads) if i not in (0, 1, 6, 11)] == [(0, 0)] * 10
    assert Accordion.counts(engine)["decisions"] == 4
    assert Accordion.counts(engine)["reasons"]["lr_drop"] == 0


def test_old_layout_checkpoints_load_and_resume_exactly() -> None:
    """The fixture was saved by the earlier layout (plain step count, ``pending``), after 8
    steps of which one was skipped (a NaN); it holds the levels and decisions that layout took
    afterwards. Loaded, the run continues exactly as one that never stopped."""
    saved = torch.load(FIXTURE, weights_only=False)
    shapes = {"w": torch.Size([12, 8]), "v": torch.Size([6, 6]), "b": torch.Size([12])}

    def grads(step: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(50 + step)
        scale = (1.0, 3.0, 0.5)[(step // 3) % 3]
        g = {n: scale * torch.randn(2, *s, generator=gen) for n, s in shapes.items()}
        if step == 2:
            g["v"][1, 2, 3] = float("nan")
        return g

    for signal, old in saved.items():
        def engine(signal: str = signal) -> gradzip.Engine:
            return gradzip.Engine(shapes, Accordion("powersgd:rank=1", "powersgd:rank=4",
                                                    interval=3, signal=signal),
                                  collective=SimulatedGroup(2), decide_on="device")

        straight, resumed = engine(), engine()
        for step in range(8):
            straight.reduce(grads(step))
        resumed.load_state_dict(old["checkpoint"])
        assert int(resumed.compressor_state["controller"]["step"]) == 7  # one step skipped
        levels = []
        for step in range(8, 16):
            a, b = straight.reduce(grads(step)), resumed.reduce(grads(step))
            assert all(torch.equal(a[n], b[n]) for n in shapes), (signal, step)
            levels.append(Accordion.levels(resumed))
        assert levels == old["levels_after"]
        assert Accordion.decisions(resumed, since=0) == old["decisions"]
        assert Accordion.counts(resumed) == old["counts"] == Accordion.counts(straight)


def test_old_layout_with_an_unreadable_step_is_refused_clearly() -> None:
    state = torch.load(FIXTURE, weights_only=False)["raw"]["checkpoint"]
    state["compressor_state"]["controller"]["step"] = 99  # beyond the engine's 8 steps
    engine = gradzip.Engine({"w": torch.Size([12, 8]), "v": torch.Size([6, 6]),
                             "b": torch.Size([12])},
                            Accordion("powersgd:rank=1", "powersgd:rank=4", interval=3),
                            collective=SimulatedGroup(2))
    with pytest.raises(ValueError, match=r"earlier layout.*controller.step must be an integer "
                                         r"in \[0, 8\].*got 99"):
        engine.load_state_dict(state)
