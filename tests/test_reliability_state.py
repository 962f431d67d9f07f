"""Tampered compression state: ``load_state_dict`` checks values and consistency, not only
structure and kinds, and a refused load changes nothing. Genuine checkpoints, taken at any
point (pending decisions, LR drops, holds, budgets not yet calibrated), still load."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import gradzip
from conformance import SHAPES, SPECS, make_grads

ACCORDION = "accordion(steady=topk:ratio=0.05,critical=topk:ratio=0.2,interval=3)"
THRESHOLD_ACCORDION = "accordion(steady=threshold:lam=2.5,critical=threshold:lam=1.5,interval=2)"


def trained(spec: str, steps: int = 5, **kwargs: Any) -> gradzip.Engine:
    """An engine of ``spec`` after ``steps`` steps, with a learning-rate drop at step 3."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    engine = gradzip.Engine(SHAPES, spec, collective=gradzip.SimulatedGroup(2), optimizer=opt,
                            **kwargs)
    for step in range(steps):
        if step == 3:
            opt.param_groups[0]["lr"] = 0.01
        engine.reduce(make_grads(2, step))
    return engine


def refused(engine: gradzip.Engine, edit: Callable[[dict[str, Any]], None], *needles: str) -> None:
    """Edit a copy of the engine's checkpoint; loading it raises one line naming ``needles``,
    and leaves the engine exactly as it was."""
    before = engine.state_dict()
    state = copy.deepcopy(before)
    edit(state)
    with pytest.raises(ValueError) as info:
        engine.load_state_dict(state)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
    after = engine.state_dict()
    assert repr(after) == repr(before)  # tensors print their values: nothing changed


def ctrl(state: dict[str, Any]) -> dict[str, Any]:
    return state["compressor_state"]["controller"]


@pytest.mark.parametrize("spec", SPECS)
def test_genuine_checkpoints_load(spec: str) -> None:
    for steps in (0, 1, 3, 4, 6):
        engine = trained(spec, steps)
        state = engine.state_dict()
        fresh = gradzip.Engine(SHAPES, spec, collective=gradzip.SimulatedGroup(2))
        fresh.load_state_dict(state)
        assert repr(fresh.state_dict()) == repr(state)


@pytest.mark.parametrize("options", [{"signal": "sent"}, {"lr_hold": "boundary"},
                                     {"per_layer": False}])
def test_genuine_accordion_checkpoints_of_every_variant_load(options: dict[str, Any]) -> None:
    spec = gradzip.Accordion("threshold:budget=0.05", "threshold:budget=0.2", interval=3,
                             window=2, **options)
    sums = 0
    for steps in range(8):
        state = trained(spec, steps).state_dict()
        sums += any(t is not None for t in ctrl(state)["acc"].values())
        gradzip.Engine(SHAPES, spec, collective=gradzip.SimulatedGroup(2)).load_state_dict(state)
    assert sums  # some checkpoints were taken with a window being summed


def test_accordion_level_with_an_unknown_name_is_refused() -> None:
    engine = trained(ACCORDION)
    refused(engine, lambda s: ctrl(s)["level"].update({"fc.weight": "gentle"}),
            "controller.level.fc.weight", "'gentle'")


@pytest.mark.parametrize(("path", "value"), [
    (("step",), -1), (("step",), torch.tensor(-1)), (("interval",), -2),
    (("counts", "switches"), -1), (("tally", "critical_steps"), torch.tensor(-5)),
    (("offset",), -1), (("counts", "reasons", "lr_drop"), -1),
    (("counts", "decisions"), 0),
])
def test_accordion_negative_counters_are_refused(path: tuple[str, ...], value: Any) -> None:
    def edit(state: dict[str, Any]) -> None:
        node = ctrl(state)
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    refused(trained(ACCORDION), edit, "controller." + path[0])


@pytest.mark.parametrize("interval", [0, -3, 7])
def test_accordion_hold_interval_other_than_the_configuration_is_refused(interval: int) -> None:
    refused(trained(ACCORDION), lambda s: ctrl(s)["hold"].update(interval=interval),
            "controller.hold", f"'interval': {interval}")


@pytest.mark.parametrize("nxt", [0, 4, 9])
def test_accordion_next_decision_out_of_reach_is_refused(nxt: int) -> None:
    # At step 5 with interval 3 the next decision must fall in [5, 8] (at 5: due, taken at
    # the next call); below the step it would never come, and no decision would be taken
    # again.
    refused(trained(ACCORDION), lambda s: ctrl(s).update(next=nxt), "controller.next", "[5, 8]")


@pytest.mark.parametrize("norm", [-1.0, float("nan"), float("inf"), "big", True])
def test_accordion_prev_norm_negative_or_not_a_number_is_refused(norm: Any) -> None:
    refused(trained(ACCORDION), lambda s: ctrl(s)["prev_norm"].update({"fc.weight": norm}),
            "prev_norm")


@pytest.mark.parametrize("acc", [torch.zeros(3, 32, 64), torch.zeros(32, 64),
                                 torch.zeros(2, 32, 64, dtype=torch.float64), "sum"])
def test_accordion_window_sum_of_the_wrong_shape_or_kind_is_refused(acc: Any) -> None:
    engine = trained(ACCORDION, 6)  # a window is being summed: the entry is a tensor
    assert isinstance(ctrl(engine.state_dict())["acc"]["fc.weight"], torch.Tensor)
    refused(engine, lambda s: ctrl(s)["acc"].update({"fc.weight": acc}), "acc.fc.weight")


def test_accordion_other_consistency_problems_are_refused() -> None:
    engine = trained(ACCORDION)
    refused(engine, lambda s: ctrl(s).update(drop_step=99), "controller.drop_step")
    refused(engine, lambda s: ctrl(s).update(fixed=["fc.weight"]), "controller.fixed")
    refused(engine, lambda s: ctrl(s).update(per_layer=False), "controller.per_layer")
    refused(engine, lambda s: ctrl(s).update(last_lr=-0.1), "controller.last_lr")
    refused(engine, lambda s: ctrl(s).update(log=[{"level": "critical"}]), "controller.log[0]")
    sent = trained(gradzip.Accordion("topk:ratio=0.05", "topk:ratio=0.2", interval=3,
                                     signal="sent"))
    # With signal="sent" a decision is taken at the end of the step that makes it due.
    refused(sent, lambda s: ctrl(s).update(next=5), "controller.next", "[6, 8]")


def test_schedule_level_with_an_unknown_name_is_refused() -> None:
    spec = "schedule(gentle=none,aggressive=topk:ratio=0.05,gentle_steps=0-2)"
    engine = trained(spec)
    refused(engine, lambda s: ctrl(s)["level"].update({"conv.weight": "aggressive"}),
            "controller.level.conv.weight")
    refused(engine, lambda s: ctrl(s).update(drop_until=-1), "controller.drop_until")


@pytest.mark.parametrize("lam", [0.0, -2.5, 1.0])
def test_threshold_lam_other_than_the_configuration_is_refused(lam: float) -> None:
    engine = trained("threshold:lam=2.5")
    refused(engine, lambda s: s["compressor_state"].update(lam=lam), "lam", repr(lam))


@pytest.mark.parametrize("lam", [0.0, -2.5, -1e-9])
def test_threshold_budget_lam_not_positive_is_refused(lam: float) -> None:
    engine = trained("threshold:budget=0.02")
    refused(engine, lambda s: s["compressor_state"].update(lam=lam), "lam", "> 0")


def test_threshold_counters_are_checked() -> None:
    engine = trained("threshold:budget=0.02")
    refused(engine, lambda s: s["compressor_state"].update(sent=-1), "sent")
    refused(engine, lambda s: s["compressor_state"].update(sent=10**12), "sent", "<= offered")
    refused(engine, lambda s: s["compressor_state"].update(step_offered=5), "step_offered")
    refused(engine, lambda s: s["compressor_state"].update(recent=1.5), "recent")


def test_threshold_state_keeps_integer_counters_without_capacity() -> None:
    """The default (exchanged sizes) keeps the counters as Python integers, so an earlier
    checkpoint of a threshold's state loads and resumes exactly; a capacity keeps them on
    the device as 0-d float64 tensors."""
    source = trained("threshold:lam=0.5")
    state = source.state_dict()
    assert all(type(state["compressor_state"][k]) is int for k in ("sent", "offered"))
    assert state["compressor_state"]["sent"] > 0
    target = gradzip.Engine(SHAPES, "threshold:lam=0.5", collective=gradzip.SimulatedGroup(2))
    target.load_state_dict(copy.deepcopy(state))
    grads = make_grads(2, 9)
    want, got = source.reduce(grads), target.reduce(grads)
    assert all(torch.equal(want[name], got[name]) for name in SHAPES)
    assert target.state_dict()["compressor_state"] == source.state_dict()["compressor_state"]
    capacity = trained("threshold:lam=0.5,capacity=0.05").state_dict()["compressor_state"]
    assert capacity["sent"].dtype == torch.float64 and capacity["sent"].dim() == 0


def test_threshold_capacity_counters_are_checked() -> None:
    engine = trained("threshold:budget=0.02,capacity=0.04")

    def count(v: float) -> torch.Tensor:  # with a capacity the counters are 0-d float64 tensors
        return torch.tensor(v, dtype=torch.float64)

    refused(engine, lambda s: s["compressor_state"].update(sent=count(-1)), "sent")
    refused(engine, lambda s: s["compressor_state"].update(sent=count(2.5)), "sent", "whole number")
    refused(engine, lambda s: s["compressor_state"].update(sent=count(10**12)), "sent", "<= offered")
    refused(engine, lambda s: s["compressor_state"].update(step_offered=count(5)), "step_offered")
    refused(engine, lambda s: s["compressor_state"].update(recent=1.5), "recent")


def test_a_level_inside_accordion_is_checked_too() -> None:
    engine = trained(THRESHOLD_ACCORDION)
    refused(engine, lambda s: s["compressor_state"]["steady"].update(lam=0.0),
            "compressor_state.steady.lam")


def test_the_state_of_a_rule_is_checked_and_named() -> None:
    engine = trained("topk:ratio=0.1", rules=[("fc.*", ACCORDION)])
    refused(engine, lambda s: s["rule_states"][0]["controller"]["level"].update(
        {"fc.weight": "medium"}), "rule_states[0].controller.level.fc.weight")


def test_a_residual_missing_from_the_checkpoint_is_refused() -> None:
    engine = trained("topk:ratio=0.1")
    assert engine.state_dict()["without_residual"] == []
    refused(engine, lambda s: s["residuals"].pop("fc.weight"), "'fc.weight'", "without_residual")
    refused(engine, lambda s: s.update(without_residual=["fc.weight"]), "'fc.weight'",
            "has a residual")
    refused(engine, lambda s: s.update(without_residual=["nope"]), "'nope'")


def test_parameters_not_reduced_yet_are_listed_and_load() -> None:
    """A parameter the engine has not reduced has no residual; the checkpoint says so, and
    the resumed engine matches the original on the next step."""
    engine = gradzip.Engine(SHAPES, "topk:ratio=0.1", collective=gradzip.SimulatedGroup(2))
    grads = make_grads(2, 0)
    engine.reduce({n: g for n, g in grads.items() if n != "conv.weight"})
    state = engine.state_dict()
    assert state["without_residual"] == ["conv.weight"]
    resumed = gradzip.Engine(SHAPES, "topk:ratio=0.1", collective=gradzip.SimulatedGroup(2))
    resumed.load_state_dict(state)
    later = make_grads(2, 1)
    expected, got = engine.reduce(later), resumed.reduce(later)
    assert all(torch.equal(expected[n], got[n]) for n in later)


def test_checkpoints_of_earlier_versions_without_the_list_still_load() -> None:
    state = trained("topk:ratio=0.1").state_dict()
    del state["without_residual"]
    gradzip.Engine(SHAPES, "topk:ratio=0.1", collective=gradzip.SimulatedGroup(2)).load_state_dict(state)
