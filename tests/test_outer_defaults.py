"""The outer optimizer's H-dependent defaults: the measured rule, where it applies (Outer,
the runner, the planner's candidates), explicit values winning over it, and its input checks."""

from __future__ import annotations

import math

import pytest

import gradzip
from gradzip.outer.defaults import NESTEROV_BY_H, outer_defaults
from gradzip.outer.optim import OuterOptimizer
from gradzip.plan.candidates import Candidate, default_candidates
from outer_helpers import make_model

#: The rule measured by benchmarks/outer_sweep.py (benchmarks/results/outer_sweep.md).
MEASURED = {10: (0.7, 0.5), 30: (0.7, 0.5), 100: (0.7, 0.5), 500: (0.7, 0.9)}


def _outer(h: int, **kwargs):  # type: ignore[no-untyped-def]
    return gradzip.Outer([make_model() for _ in range(2)], "none", inner_steps=h,
                         collective=gradzip.SimulatedGroup(2), **kwargs)


@pytest.mark.parametrize("h", sorted(MEASURED))
def test_outer_takes_the_measured_setting_at_each_measured_h(h: int) -> None:
    assert outer_defaults(h) == MEASURED[h]
    outer = _outer(h)
    assert (outer.optimizer.lr, outer.optimizer.momentum) == MEASURED[h]
    assert f"lr={MEASURED[h][0]}" in outer.checkpoint_config()["outer_optimizer"]


def test_between_anchors_linear_in_log_h_and_constant_outside() -> None:
    (h0, lr0, m0), (h1, lr1, m1) = NESTEROV_BY_H[-2], NESTEROV_BY_H[-1]
    mid = round(math.sqrt(h0 * h1))  # halfway in log H (up to the rounding of H)
    t = (math.log(mid) - math.log(h0)) / (math.log(h1) - math.log(h0))
    assert outer_defaults(mid) == (round(lr0 + t * (lr1 - lr0), 3), round(m0 + t * (m1 - m0), 3))
    assert 0.5 < outer_defaults(mid)[1] < 0.9
    assert outer_defaults(1) == outer_defaults(NESTEROV_BY_H[0][0])
    assert outer_defaults(10_000) == outer_defaults(NESTEROV_BY_H[-1][0])
    momenta = [outer_defaults(h)[1] for h in range(1, 2000)]
    assert momenta == sorted(momenta)  # never decreasing in H


def test_other_kinds_keep_their_fixed_settings_at_every_h() -> None:
    for h in (1, 10, 100, 1000):
        assert outer_defaults(h, "sgd") == (1.0, 0.0)
        assert outer_defaults(h, "ef-momentum") == (1.0, 0.0)
    outer = _outer(10, outer_optimizer="sgd")
    assert (outer.optimizer.lr, outer.optimizer.momentum) == (1.0, 0.0)


def test_explicit_values_are_honoured_each_on_its_own() -> None:
    rule_lr, rule_m = outer_defaults(10)
    outer = _outer(10, outer_lr=0.9)
    assert (outer.optimizer.lr, outer.optimizer.momentum) == (0.9, rule_m)
    outer = _outer(10, outer_momentum=0.5)
    assert (outer.optimizer.lr, outer.optimizer.momentum) == (rule_lr, 0.5)
    # An OuterOptimizer instance is a complete record: its values are used as they are.
    outer = _outer(10, outer_optimizer=OuterOptimizer("nesterov", lr=0.7, momentum=0.9))
    assert (outer.optimizer.lr, outer.optimizer.momentum) == (0.7, 0.9)
    outer = _outer(10, outer_optimizer=OuterOptimizer("nesterov"))
    assert (outer.optimizer.lr, outer.optimizer.momentum) == (0.7, 0.9)


@pytest.mark.parametrize("args, exc, message", [
    ((0,), ValueError, "`inner_steps` must be >= 1, got 0"),
    ((True,), TypeError, "`inner_steps` must be an integer, got True"),
    ((10.0,), TypeError, "`inner_steps` must be an integer, got 10.0"),
    ((10, "adam"), ValueError, "`kind` must be one of"),
])
def test_the_rule_validates_its_inputs(args: tuple, exc: type, message: str) -> None:
    with pytest.raises(exc, match=message.replace("(", r"\(")):
        outer_defaults(*args)


def test_a_bad_explicit_value_is_still_refused_naming_the_parameter() -> None:
    with pytest.raises(ValueError, match="`outer_lr` must be > 0, got 0"):
        _outer(10, outer_lr=0.0)
    with pytest.raises(ValueError, match="`outer_momentum` must be in"):
        _outer(30, outer_momentum=1.0)
    with pytest.raises(ValueError, match="`outer_optimizer` must be one of"):
        _outer(30, outer_optimizer="adam")


def test_the_planners_outer_candidates_carry_the_rule_and_explicit_values() -> None:
    outer = [c for c in default_candidates() if c.outer_steps]
    assert {c.outer_steps for c in outer} == {10, 30, 100}
    for c in outer:
        assert (c.outer_lr, c.outer_momentum) == outer_defaults(c.outer_steps)
        assert c.describe_outer() == (f"H={c.outer_steps}, outer lr {c.outer_lr:g}, "
                                      f"momentum {c.outer_momentum:g}")
    assert Candidate("o", "none", "outer", 30, outer_lr=0.2).outer_lr == 0.2
    per_step = Candidate("p", "none", "lossless")
    assert (per_step.outer_lr, per_step.outer_momentum, per_step.describe_outer()) == (None, None, "")


@pytest.mark.parametrize("kwargs, exc, message", [
    (dict(quality="outer", outer_steps=10, outer_lr=0.0), ValueError, "`outer_lr` must be > 0"),
    (dict(quality="outer", outer_steps=10, outer_momentum=1.0), ValueError, "`outer_momentum`"),
    (dict(quality="outer", outer_steps=10, outer_lr="a"), TypeError, "`outer_lr` must be a real"),
    (dict(quality="gentle", outer_momentum=0.5), ValueError,
     "`outer_momentum` must be None for a per-step candidate"),
])
def test_candidate_outer_settings_are_validated(kwargs: dict, exc: type, message: str) -> None:
    with pytest.raises(exc, match=message):
        Candidate("c", "none", **kwargs)


def test_the_plan_names_the_outer_settings_of_its_choice() -> None:
    from gradzip.plan import Setting, plan

    result = plan(Setting(workers=8, bandwidth_mbit=1, rtt_ms=50, step_ms=10), params=1_000_000,
                  qualities=("outer",), measure=False)
    c = result.choice.candidate
    assert c.outer_steps and c.describe_outer() in result.reason
    row = next(p.as_dict() for p in result.predictions if p.candidate is c)
    assert (row["outer_lr"], row["outer_momentum"]) == outer_defaults(c.outer_steps)
