"""The outer loop's input checks, non-finite pseudo-gradients and offloaded state."""

from __future__ import annotations

import pytest
import torch

import gradzip
from gradzip.outer import FragmentPlan, OuterOptimizer
from outer_helpers import inner_step, make_inner, make_model, run_simulated


def _models(n: int = 2) -> list[torch.nn.Module]:
    return [make_model() for _ in range(n)]


def _outer(**kwargs):
    kwargs.setdefault("inner_steps", 2)
    return gradzip.Outer(_models(), "none", collective=gradzip.SimulatedGroup(2), **kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(inner_steps=0), "`inner_steps` must be >= 1, got 0"),
    (dict(inner_steps=1.5), "`inner_steps` must be an integer"),
    (dict(inner_steps=14, fragments=7), "`fragments` must be at most the number of tensors (6), got 7"),
    (dict(inner_steps=5, fragments=2), "`inner_steps` must be a multiple of `fragments` (2), got 5"),
    (dict(inner_steps=4, fragments=2, delay=2), "`delay` must be in [0, 1], got 2"),
    (dict(alpha=1.5), "`alpha` must be in [0, 1], got 1.5"),
    (dict(outer_optimizer="adam"), "`outer_optimizer` must be one of"),
    (dict(outer_optimizer="nesterov", outer_momentum=0.0), "`outer_momentum` must be in (0, 1) for the nesterov"),
    (dict(outer_optimizer="ef-momentum", outer_momentum=0.9), "`outer_momentum` must be 0 for the ef-momentum"),
    (dict(outer_optimizer="sgd", error_decay=0.9), "`error_decay` must be 1.0 unless"),
    (dict(outer_optimizer="ef-momentum", error_feedback=False), "`error_feedback` must be on"),
    (dict(outer_lr=-1.0), "`outer_lr` must be > 0, got -1.0"),
    (dict(offload="yes"), "`offload` must be a bool"),
])
def test_bad_input_is_one_line_error_naming_the_parameter(kwargs, message) -> None:
    with pytest.raises((TypeError, ValueError)) as info:
        _outer(**kwargs)
    text = str(info.value)
    assert "\n" not in text
    assert message in text, text


def test_gradient_only_engine_options_and_bad_models_are_refused() -> None:
    models = _models()
    opt = torch.optim.SGD(models[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match="`optimizer` applies to gradients, not pseudo-gradients"):
        gradzip.Outer(models, "none", inner_steps=2, collective=gradzip.SimulatedGroup(2), optimizer=opt)
    with pytest.raises(ValueError, match=r"`models` must hold one module per local worker \(3\), got 2"):
        gradzip.Outer(models, "none", inner_steps=2, collective=gradzip.SimulatedGroup(3))
    with torch.no_grad():
        next(models[1].parameters()).add_(1.0)
    with pytest.raises(ValueError, match="must start from identical parameters"):
        gradzip.Outer(models, "none", inner_steps=2, collective=gradzip.SimulatedGroup(2))
    with pytest.raises(TypeError, match="`compressor`|spec"):
        gradzip.Outer(_models(), 3.0, inner_steps=2, collective=gradzip.SimulatedGroup(2))  # type: ignore[arg-type]


def test_fragment_plan_schedule() -> None:
    plan = FragmentPlan(6, fragments=3, delay=1)
    assert [plan.sent_after(s) for s in range(1, 13)] == [None, 0, None, 1, None, 2] * 2
    assert [FragmentPlan(3).sent_after(s) for s in range(7)] == [None, None, None, 0, None, None, 0]


def _poison(model: torch.nn.Module) -> None:
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")


def test_non_finite_pseudo_gradient_is_skipped_and_workers_return_to_the_anchor() -> None:
    models = _models()
    opts = [make_inner(m) for m in models]
    outer = gradzip.Outer(models, "topk:ratio=0.2", inner_steps=2, collective=gradzip.SimulatedGroup(2),
                          outer_optimizer="sgd")
    for step in range(2):
        for rank, (m, o) in enumerate(zip(models, opts, strict=True)):
            inner_step(m, o, step, rank)
        outer.step()
    anchor = {n: t.clone() for n, t in outer.anchor.items()}
    residuals = {n: r.clone() for n, r in outer.engine.residuals.items()}
    for step in range(2, 4):
        for rank, (m, o) in enumerate(zip(models, opts, strict=True)):
            inner_step(m, o, step, rank)
        if step == 3:
            _poison(models[1])  # one worker's pseudo-gradient turns non-finite
        outer.step()
    assert outer.stats["skipped_syncs"] == 1 and outer.stats["syncs"] == 2
    for name, value in outer.anchor.items():
        assert torch.equal(value, anchor[name])
        assert torch.equal(outer.engine.residuals[name], residuals[name])
    for m in models:  # both workers back at the anchor, finite
        for name, p in m.named_parameters():
            assert torch.equal(p, anchor[name])


def test_non_finite_with_raise_changes_nothing() -> None:
    models = _models()
    outer = gradzip.Outer(models, "none", inner_steps=1, collective=gradzip.SimulatedGroup(2), nonfinite="raise")
    _poison(models[0])
    before = outer.state_dict()
    with pytest.raises(FloatingPointError):
        outer.step()
    after = outer.state_dict()
    assert after["inner_step"] == before["inner_step"] == 0 and after["syncs"] == 0
    for name in before["anchor"]:
        assert torch.equal(after["anchor"][name], before["anchor"][name])


def test_offload_keeps_anchor_and_outer_state_on_the_cpu_with_the_same_results() -> None:
    on, outer_on = run_simulated(2, 6, "none", inner_steps=2, offload=True)
    off, _ = run_simulated(2, 6, "none", inner_steps=2)
    assert all(t.device.type == "cpu" for t in outer_on.anchor.values())
    assert outer_on.outer_state and all(t.device.type == "cpu" for t in outer_on.outer_state.values())
    for a, b in zip(on[0].parameters(), off[0].parameters(), strict=True):
        assert torch.equal(a, b)


def test_load_state_dict_refuses_another_configuration() -> None:
    outer = _outer(inner_steps=2)
    state = outer.state_dict()
    other = _outer(inner_steps=4)
    with pytest.raises(ValueError, match="same outer configuration"):
        other.load_state_dict(state)
    state["anchor"] = {n: t * float("nan") for n, t in state["anchor"].items()}
    with pytest.raises(ValueError, match="NaN or Inf"):
        outer.load_state_dict(state)


def test_outer_optimizer_build_overrides() -> None:
    opt = OuterOptimizer.build("ef-momentum", decay=0.9)
    assert (opt.kind, opt.lr, opt.momentum, opt.decay) == ("ef-momentum", 1.0, 0.0, 0.9)
    assert OuterOptimizer.build(opt, lr=0.5).lr == 0.5
    with pytest.raises(TypeError, match="`outer_optimizer` must be"):
        OuterOptimizer.build(3)  # type: ignore[arg-type]
