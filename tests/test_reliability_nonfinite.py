"""Non-finite values: produced inside compression, in engines with or without state, and in a
step of several calls. The invariant: after every step that reports success, the average and
all compression state are finite; a step that overflows is handled by the policy, identically
on every worker, and ``skipped_steps`` counts it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import gradzip
from conformance import SHAPES, SPECS, make_grads
from gradzip.compressors.powersgd import _settle
from gradzip.statecheck import check_tree, first_nonfinite

STATELESS = [("none", None), ("fp16", None), ("bf16", None), ("qsgd:levels=4", None),
             ("topk:ratio=0.05", False), ("sign", False)]


def engine_for(spec: str, workers: int = 3, **kwargs: object) -> gradzip.Engine:
    return gradzip.Engine(SHAPES, spec, collective=gradzip.SimulatedGroup(workers), **kwargs)


def assert_state_finite(engine: gradzip.Engine) -> None:
    for name, res in engine.residuals.items():
        assert bool(torch.isfinite(res).all()), name
    assert first_nonfinite(engine.compressor_state, "state") is None


def huge(workers: int, step: int, magnitude: float, where: str) -> dict[str, torch.Tensor]:
    """Gradients with finite but huge entries: one entry, or a whole tensor."""
    grads = make_grads(workers, step)
    if where == "entry":
        grads["fc.weight"][0, 3, 5] = magnitude
    else:
        grads["conv.weight"] = grads["conv.weight"].sign() * magnitude
    return grads


# -- part 1: overflow inside compression --------------------------------------------------------
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize(("magnitude", "where"), [(1e20, "entry"), (1e37, "tensor"), (3.4e38, "entry")])
def test_overflow_inside_compression_never_poisons_state(spec: str, magnitude: float, where: str) -> None:
    engine = engine_for(spec)
    for step in range(6):
        grads = huge(3, step, magnitude, where) if step in (1, 2) else make_grads(3, step)
        skipped = engine.stats["skipped_steps"]
        out = engine.reduce(grads)
        if engine.stats["skipped_steps"] > skipped:
            assert all(bool(torch.isnan(v).all()) for v in out.values()), (spec, step)
        else:
            assert all(bool(torch.isfinite(v).all()) for v in out.values()), (spec, step)
        assert_state_finite(engine)
    # Once the huge gradients stop, training goes on with finite results.
    assert all(bool(torch.isfinite(v).all()) for v in out.values()), spec


def test_the_reported_examples_recover() -> None:
    """PowerSGD rank 1 with one entry at 1e20, Sign with a whole tensor at 1e37: the steps
    that follow are finite instead of NaN forever (the huge step itself is either compressed
    finitely or skipped and counted)."""
    for spec, magnitude, where in (("powersgd:rank=1", 1e20, "entry"), ("sign", 1e37, "tensor")):
        engine = engine_for(spec, workers=2)
        engine.reduce(make_grads(2, 0))
        out = engine.reduce(huge(2, 1, magnitude, where))
        finite = all(bool(torch.isfinite(v).all()) for v in out.values())
        assert engine.stats["skipped_steps"] == (0 if finite else 1), spec
        for step in range(2, 5):
            out = engine.reduce(make_grads(2, step))
            assert all(bool(torch.isfinite(v).all()) for v in out.values()), (spec, step)
        assert_state_finite(engine)


def test_residual_plus_gradient_overflow_counts_as_nonfinite() -> None:
    """A finite gradient plus a finite residual that overflow: handled before anything is sent."""
    engine = gradzip.Engine({"w": torch.Size([64])}, "topk:ratio=0.1", collective=gradzip.SimulatedGroup(2))
    engine.reduce({"w": torch.randn(2, 64, generator=torch.Generator().manual_seed(0))})
    state = engine.state_dict()
    state["residuals"]["w"] = torch.full((2, 64), 3e38)  # huge, but finite: a valid checkpoint
    engine.load_state_dict(state)
    calls_before = engine.stats["collective_calls"]
    out = engine.reduce({"w": torch.full((2, 64), 3e38)})["w"]
    assert engine.stats["skipped_steps"] == 1 and bool(torch.isnan(out).all())
    assert engine.stats["collective_calls"] == calls_before + 1  # the header only
    assert torch.equal(engine.residuals["w"], torch.full((2, 64), 3e38))  # rolled back


def test_powersgd_poisons_the_message_of_a_worker_whose_residual_overflows() -> None:
    """Rank 2: one worker's decoded message ``P Q_w^T`` sums two near-maximal terms and
    overflows, while the other worker's opposite ``Q`` would make the average finite. That
    worker's ``Q`` factor is replaced by NaN before it is summed, so every worker's average
    turns non-finite and the engine applies the policy everywhere."""
    key = (2, 2, 2)
    mats = {key: torch.zeros(2, 1, 2, 2)}  # [L, B, rows, cols]
    ps = {key: torch.full((1, 2, 2), 0.7071)}  # [B, rows, r]
    qt = torch.full((2, 1, 2, 2), 3e38)  # [L, B, r, cols]
    qt[1] = -1.0  # summed with worker 0's factor: finite
    residuals = torch.empty(2, 4)
    _settle([key], ps, {key: qt}, mats, residuals, [residuals.view(2, 1, 2, 2)], 2, None)
    assert bool(torch.isnan(qt[0]).all())
    assert torch.equal(qt[1], torch.full((1, 2, 2), -1.0))
    assert not bool(torch.isfinite(residuals[0]).all())
    engine = gradzip.Engine({"w": torch.Size([4, 4])}, "powersgd:rank=2,min_compression_rate=1",
                            collective=gradzip.SimulatedGroup(2))
    engine.reduce({"w": torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(1))})
    assert_state_finite(engine)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    spec=st.sampled_from(SPECS),
    exponent=st.floats(0, 38.5),
    entries=st.integers(1, 40),
    worker=st.integers(0, 1),
    seed=st.integers(0, 5),
)
@example(spec="powersgd:rank=2", exponent=38.5, entries=40, worker=0, seed=0)
@example(spec="sign", exponent=37.0, entries=40, worker=1, seed=1)
@example(spec="fp16", exponent=6.0, entries=1, worker=0, seed=0)  # fp16 overflow of the message
def test_state_stays_finite_for_any_magnitude(
    spec: str, exponent: float, entries: int, worker: int, seed: int
) -> None:
    engine = engine_for(spec, workers=2)
    gen = torch.Generator().manual_seed(seed)
    for step in range(3):
        grads = make_grads(2, step, seed=seed)
        flat = grads["fc.weight"][worker].reshape(-1)
        picks = torch.randperm(flat.numel(), generator=gen)[:entries]
        value = min(10.0**exponent, 3.4e38)
        flat[picks] = value * torch.sign(torch.randn(entries, generator=gen))
        out = engine.reduce(grads)
        finite = all(bool(torch.isfinite(v).all()) for v in out.values())
        assert finite or all(bool(torch.isnan(v).all()) for v in out.values())
        assert_state_finite(engine)
    assert engine.stats["steps"] == 3


# -- part 2: engines without state, and steps of several calls ------------------------------------
@pytest.mark.parametrize(("spec", "error_feedback"), STATELESS)
def test_policies_apply_to_engines_without_state(spec: str, error_feedback: bool | None) -> None:
    bad = make_grads(3, 0)
    bad["conv.weight"][1, 0, 0, 0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="NaN or Inf at step 0"):
        engine_for(spec, error_feedback=error_feedback, nonfinite="raise").reduce(bad)
    skip = engine_for(spec, error_feedback=error_feedback)
    assert not skip.residuals and (skip.error_feedback is False)
    out = skip.reduce(bad)
    assert all(bool(torch.isnan(v).all()) for v in out.values())
    assert skip.stats["skipped_steps"] == 1 and skip.stats["steps"] == 1
    zero = engine_for(spec, error_feedback=error_feedback, nonfinite="zero")
    out = zero.reduce(bad)
    assert all(torch.equal(v, torch.zeros_like(v)) for v in out.values())
    assert zero.stats["skipped_steps"] == 1


def calls(grads: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Three calls, as three DDP buckets: {conv.weight}, {conv.bias, fc.weight}, {scale}."""
    return [{"conv.weight": grads["conv.weight"]},
            {"conv.bias": grads["conv.bias"], "fc.weight": grads["fc.weight"]},
            {"scale": grads["scale"]}]


def step_in_calls(engine: gradzip.Engine, grads: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    parts = calls(grads)
    return [engine.reduce(p, finish_step=i == len(parts) - 1) for i, p in enumerate(parts)]


SEVERAL = ["topk:ratio=0.05", "powersgd:rank=2", "threshold:budget=0.02", "fp16",
           "accordion(steady=topk:ratio=0.05,critical=topk:ratio=0.2,eta=0.5,interval=1,per_layer=True,lr_drop=True)"]


@pytest.mark.parametrize("spec", SEVERAL)
def test_skip_rolls_back_the_whole_step_and_poisons_its_later_calls(spec: str) -> None:
    engine = engine_for(spec)
    step_in_calls(engine, make_grads(3, 0))
    before = engine.state_dict()
    bad = make_grads(3, 1)
    bad["fc.weight"][2, 0, 0] = float("inf")  # the middle call
    first, middle, last = step_in_calls(engine, bad)
    assert all(bool(torch.isfinite(v).all()) for v in first.values())
    assert all(bool(torch.isnan(v).all()) for v in (*middle.values(), *last.values()))
    after = engine.state_dict()
    assert after["step"] == 2 and after["skipped_steps"] == 1
    for name, res in before["residuals"].items():
        assert torch.equal(res, after["residuals"][name]), name
    assert check_tree(before["compressor_state"], after["compressor_state"], "s") is None
    assert first_nonfinite(after["compressor_state"], "s") is None


@pytest.mark.parametrize("spec", SEVERAL)
def test_zero_drops_only_the_bad_call_and_keeps_the_rest_of_the_step(spec: str) -> None:
    """The call's tensors keep their state and get zeros; the other calls of the step are
    applied and keep their state updates, exactly as a step without the bad call."""
    hit, ref = engine_for(spec, nonfinite="zero"), engine_for(spec)
    for engine in (hit, ref):
        step_in_calls(engine, make_grads(3, 0))
    bad = make_grads(3, 1)
    bad["fc.weight"][0, 1, 1] = float("nan")
    first, middle, last = step_in_calls(hit, bad)
    parts = calls(bad)
    want_first = ref.reduce(parts[0], finish_step=False)
    want_last = ref.reduce(parts[2], finish_step=True)
    assert all(torch.equal(v, torch.zeros_like(v)) for v in middle.values())
    for got, want in ((first, want_first), (last, want_last)):
        for name in want:
            assert torch.equal(got[name], want[name]), name
    assert hit.stats["skipped_steps"] == 1 and ref.stats["skipped_steps"] == 0
    assert hit.residuals.keys() == ref.residuals.keys()
    for name in hit.residuals:
        assert torch.equal(hit.residuals[name], ref.residuals[name]), name
    # And the next step runs on finite state in both.
    for engine in (hit, ref):
        out = engine.reduce(make_grads(3, 2))
        assert all(bool(torch.isfinite(v).all()) for v in out.values())


@pytest.mark.parametrize("spec", ["topk:ratio=0.05", "none", "powersgd:rank=2"])
def test_raise_abandons_the_step_and_leaves_a_usable_engine(spec: str) -> None:
    engine = engine_for(spec, nonfinite="raise")
    step_in_calls(engine, make_grads(3, 0))
    before = engine.state_dict()
    bad = make_grads(3, 1)
    bad["scale"][1, 0] = float("nan")  # the last call
    parts = calls(bad)
    engine.reduce(parts[0], finish_step=False)
    engine.reduce(parts[1], finish_step=False)
    with pytest.raises(FloatingPointError):
        engine.reduce(parts[2], finish_step=True)
    after = engine.state_dict()  # works after an exception inside a step
    assert after["step"] == before["step"] == 1 and after["skipped_steps"] == 0
    for name, res in before["residuals"].items():
        assert torch.equal(res, after["residuals"][name]), name
    out = step_in_calls(engine, make_grads(3, 1))
    assert all(bool(torch.isfinite(v).all()) for part in out for v in part.values())
    assert engine.stats["steps"] == 2


def test_an_error_inside_a_step_rolls_it_back() -> None:
    engine = engine_for("topk:ratio=0.05")
    engine.reduce(make_grads(3, 0))
    before = engine.state_dict()
    parts = calls(make_grads(3, 1))
    engine.reduce(parts[0], finish_step=False)
    with pytest.raises(ValueError, match="unknown name 'nope'"):
        engine.reduce({"nope": torch.zeros(3, 2)}, finish_step=True)
    after = engine.state_dict()
    assert after["step"] == 1
    for name, res in before["residuals"].items():
        assert torch.equal(res, after["residuals"][name])


def test_header_keeps_collectives_per_call_for_engines_with_state() -> None:
    """One header per call, in place of the old flag: a Top-k call makes two collectives."""
    engine = engine_for("topk:ratio=0.05")
    step_in_calls(engine, make_grads(3, 0))
    assert engine.stats["collective_calls"] == 3 * 2
