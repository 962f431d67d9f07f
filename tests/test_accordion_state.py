"""Accordion's explicit state: one step counted per optimizer step (bucketed and skipped
calls), what a level switch keeps (residuals, each level's warm start), bit-exact checkpoints."""

from __future__ import annotations

import io

import pytest
import torch

from gradzip import Engine, PowerSGD, SimulatedGroup
from gradzip.compressors import Job, StepContext
from gradzip.control import Accordion

S = "steady"


# -- counting steps -----------------------------------------------------------------------------
def test_bucketed_calls_decide_like_one_call_per_step() -> None:
    """A DDP hook reduces bucket by bucket (``finish_step=False`` but for the last): the
    controller must count one step per optimizer step and see an LR drop once."""

    def run(split: bool) -> tuple[list[dict[str, torch.Tensor]], Engine]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        engine = Engine(SHAPES, Accordion("topk:ratio=0.02", "topk:ratio=0.2", interval=3),
                        collective=SimulatedGroup(4), optimizer=opt)
        outs = []
        for step in range(20):
            if step == 10:
                opt.param_groups[0]["lr"] = 0.01
            grads = scaled_grads(step)
            if split:
                names = list(grads)
                out = engine.reduce({n: grads[n] for n in names[2:]}, finish_step=False)
                out.update(engine.reduce({n: grads[n] for n in names[:2]}))
            else:
                out = engine.reduce(grads)
            outs.append(out)
        return outs, engine

    (whole, a), (parts, b) = run(False), run(True)
    assert all(torch.equal(x[n], y[n]) for x, y in zip(whole, parts, strict=True) for n in SHAPES)
    assert Accordion.counts(a) == Accordion.counts(b)
    assert Accordion.counts(a)["reasons"]["lr_drop"] == len(SHAPES)
    assert a.compressor_state["controller"]["log"] == b.compressor_state["controller"]["log"]



# -- switching keeps what it should -------------------------------------------------------------
def powersgd_grads(step: int, workers: int = 4) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    base = torch.randn(32, 2, generator=torch.Generator().manual_seed(0)) @ torch.randn(
        2, 24, generator=torch.Generator().manual_seed(1))
    return {"w": base + 0.3 * torch.randn(workers, 32, 24, generator=gen),
            "b": torch.randn(workers, 32, generator=gen)}


def test_switch_keeps_residuals_and_each_levels_warm_start() -> None:
    acc = Accordion("powersgd:rank=1", "powersgd:rank=4", interval=2)
    engine = Engine({"w": torch.Size([32, 24]), "b": torch.Size([32])}, acc, collective=SimulatedGroup(4))
    for step in range(6):
        engine.reduce(powersgd_grads(step))
    assert Accordion.levels(engine)["w"] == S  # the scenario: steady from step 4 on
    Accordion.signal_lr_drop(engine)  # switch to rank 4 with a rank-1 residual pending
    residual = engine.residuals["w"]
    assert residual.abs().max() > 0.1
    state = engine.compressor_state
    q1, q4 = state["steady"]["q"]["w"], state["critical"]["q"]["w"]
    # What rank 4 alone makes of gradient + carried residual, from its own stored warm start.
    grads = powersgd_grads(6)
    job = Job("w", grads["w"] + residual)
    PowerSGD(matrix_rank=4).reduce([job], {"q": {"w": q4}}, SimulatedGroup(4), StepContext(6, (0, 1, 2, 3), 4))
    out = engine.reduce(grads)
    assert torch.equal(out["w"], job.averaged)
    assert torch.equal(engine.residuals["w"], grads["w"] + residual - job.own_decoded())
    engine.reduce(powersgd_grads(7))  # the interval's last step, still at rank 4
    state = engine.compressor_state
    assert state["steady"]["q"]["w"] is q1  # rank 1's warm start untouched while rank 4 runs
    assert not torch.equal(state["critical"]["q"]["w"], q4)
    assert q1.shape == (24, 1) and q4.shape == (24, 4)


def test_skipped_step_does_not_count_towards_the_interval() -> None:
    def run(with_nan: bool) -> Engine:
        engine = Engine({"w": torch.Size([32, 24]), "b": torch.Size([32])},
                        Accordion("powersgd:rank=1", "powersgd:rank=4", interval=3),
                        collective=SimulatedGroup(4))
        for step in range(10):
            if with_nan and step == 4:
                bad = powersgd_grads(step)
                bad["b"][2, 3] = float("nan")
                engine.reduce(bad)
            engine.reduce(powersgd_grads(step))
        return engine

    clean, skipped = run(False), run(True)
    assert skipped.step == clean.step + 1 and skipped.skipped_steps == 1
    assert clean.compressor_state["controller"]["step"] == skipped.compressor_state["controller"]["step"]
    assert Accordion.levels(clean) == Accordion.levels(skipped)
    assert [r["norm"] for r in Accordion.decisions(clean)] == [r["norm"] for r in Accordion.decisions(skipped)]


# -- checkpoints --------------------------------------------------------------------------------
def scaled_grads(step: int, workers: int = 4) -> dict[str, torch.Tensor]:
    """Random gradients whose scale jumps every few steps, so both levels get used."""
    gen = torch.Generator().manual_seed(step)
    scale = (1.0, 1.0, 4.0, 4.0, 0.5, 0.5)[(step // 3) % 6]
    return {
        "conv.weight": scale * torch.randn(workers, 16, 8, 3, 3, generator=gen),
        "fc.weight": scale * torch.randn(workers, 32, 24, generator=gen),
        "fc.bias": scale * torch.randn(workers, 32, generator=gen),
    }


SHAPES = {n: g.shape[1:] for n, g in scaled_grads(0).items()}


@pytest.mark.parametrize(
    ("steady", "critical"),
    [("powersgd:rank=1", "powersgd:rank=4"), ("topk:ratio=0.02", "topk:ratio=0.2")],
)
@pytest.mark.parametrize("per_layer", [True, False])
def test_state_dict_round_trip_mid_interval_is_bit_exact(steady: str, critical: str, per_layer: bool) -> None:
    def engine() -> Engine:
        return Engine(SHAPES, Accordion(steady, critical, interval=3, per_layer=per_layer),
                      collective=SimulatedGroup(4))

    straight = engine()
    expected = [straight.reduce(scaled_grads(s)) for s in range(24)]
    counts = Accordion.counts(straight)
    assert counts["steady_steps"] > 0 and counts["critical_steps"] > 0  # both levels ran

    first = engine()
    for s in range(13):  # 13 = mid-interval (interval 3)
        first.reduce(scaled_grads(s))
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = engine()
    resumed.load_state_dict(torch.load(buffer, weights_only=False))
    for s in range(13, 24):
        got = resumed.reduce(scaled_grads(s))
        for name in SHAPES:
            assert torch.equal(got[name], expected[s][name]), (s, name)
    assert Accordion.decisions(resumed) == Accordion.decisions(straight)
    assert Accordion.counts(resumed) == counts
    ctrl, ref = resumed.compressor_state["controller"], straight.compressor_state["controller"]
    for name, acc in ctrl["acc"].items():
        assert (acc is None and ref["acc"][name] is None) or torch.equal(acc, ref["acc"][name])
    for name in SHAPES:
        assert torch.equal(resumed.residuals[name], straight.residuals[name])


def test_checkpoint_of_another_accordion_is_refused() -> None:
    source = Engine(SHAPES, Accordion("topk:ratio=0.02", "topk:ratio=0.2", interval=3),
                    collective=SimulatedGroup(4))
    source.reduce(scaled_grads(0))
    other = Engine(SHAPES, Accordion("topk:ratio=0.02", "topk:ratio=0.2", interval=4),
                   collective=SimulatedGroup(4))
    with pytest.raises(ValueError, match="interval=3"):
        other.load_state_dict(source.state_dict())
