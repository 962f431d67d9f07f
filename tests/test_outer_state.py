"""``Outer.load_state_dict``: all of it or nothing, with the engine's checks."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import gradzip
from outer_helpers import inner_step, make_inner, make_model, round_trip


def _trained(steps: int, **kwargs: Any) -> tuple[gradzip.Outer, list[torch.optim.Optimizer]]:
    models = [make_model() for _ in range(2)]
    opts = [make_inner(m, "adamw") for m in models]
    kwargs.setdefault("inner_steps", 4)
    outer = gradzip.Outer(models, "topk:ratio=0.2", collective=gradzip.SimulatedGroup(2),
                          inner_optimizers=opts, **kwargs)
    for step in range(steps):
        for rank, (m, o) in enumerate(zip(models, opts, strict=True)):
            inner_step(m, o, step, rank)
        outer.step()
    return outer, opts


def _snapshot(outer: gradzip.Outer, opts: list[torch.optim.Optimizer]) -> Any:
    return round_trip({"outer": outer.state_dict(), "opts": [o.state_dict() for o in opts]})


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def _nan_first(tree: dict[str, torch.Tensor]) -> None:
    name = next(iter(tree))
    tree[name] = tree[name].clone()
    tree[name].view(-1)[0] = float("nan")


def _tamper_optimizer_groups(state: dict[str, Any]) -> None:
    groups = state["inner_optimizers"][1]["param_groups"]
    groups[0]["params"] = groups[0]["params"][:-1]


def _tamper_optimizer_nan(state: dict[str, Any]) -> None:
    per_param = state["inner_optimizers"][0]["state"]
    per_param[0]["exp_avg"] = per_param[0]["exp_avg"] * float("nan")


def _tamper_optimizer_shape(state: dict[str, Any]) -> None:
    per_param = state["inner_optimizers"][0]["state"]
    per_param[0]["exp_avg"] = torch.zeros(3, 3)


def _tamper_pending_nan(state: dict[str, Any]) -> None:
    _nan_first(state["pending"]["averaged"])


def _tamper_pending_names(state: dict[str, Any]) -> None:
    averaged = state["pending"]["averaged"]
    averaged["nope"] = averaged.pop(next(iter(averaged)))


def _tamper_pending_gone(state: dict[str, Any]) -> None:
    state["pending"] = None


def _tamper_anchor_shape(state: dict[str, Any]) -> None:
    name = next(iter(state["anchor"]))
    state["anchor"][name] = torch.zeros(2, 2)


def _tamper_outer_state_nan(state: dict[str, Any]) -> None:
    _nan_first(state["outer_state"])


def _tamper_counter(state: dict[str, Any]) -> None:
    state["syncs"] += 1


def _tamper_counter_type(state: dict[str, Any]) -> None:
    state["inner_step"] = 5.5


def _tamper_missing(state: dict[str, Any]) -> None:
    del state["skipped_syncs"]


def _tamper_engine(state: dict[str, Any]) -> None:
    _nan_first(state["engine"]["residuals"])


@pytest.mark.parametrize(("tamper", "message"), [
    (_tamper_optimizer_groups, "inner optimizer 1: parameter group 0 must hold"),
    (_tamper_optimizer_nan, "inner optimizer 0: state.0.exp_avg holds NaN or Inf"),
    (_tamper_optimizer_shape, "must have shape"),
    (_tamper_pending_nan, "pending.averaged.* holds NaN or Inf"),
    (_tamper_pending_names, "pending.averaged: missing keys"),
    (_tamper_pending_gone, "`pending` must hold fragment, due and averaged"),
    (_tamper_anchor_shape, "anchor.* expected shape"),
    (_tamper_outer_state_nan, "outer_state.* holds NaN or Inf"),
    (_tamper_counter, "`syncs` must be 3 after 6 inner steps"),
    (_tamper_counter_type, "`inner_step` must be an integer >= 0"),
    (_tamper_missing, r"missing keys \['skipped_syncs'\]"),
    (_tamper_engine, "NaN or Inf"),
])
def test_a_refused_checkpoint_changes_nothing(tamper, message) -> None:
    # 6 inner steps of H = 4, P = 2, delay 1: fragment 0 is in flight (sent after step 6).
    source, _ = _trained(6, fragments=2, delay=1)
    state = round_trip(source.state_dict())
    assert state["pending"] is not None and state["pending"]["averaged"] is not None
    tamper(state)
    target, opts = _trained(3, fragments=2, delay=1)
    before = _snapshot(target, opts)
    with pytest.raises(ValueError, match=message) as info:
        target.load_state_dict(state)
    assert "\n" not in str(info.value)
    assert _same(_snapshot(target, opts), before)


def test_a_valid_checkpoint_loads_whole_and_resumes_exactly() -> None:
    source, source_opts = _trained(6, fragments=2, delay=1)
    state = round_trip(source.state_dict())
    target, opts = _trained(3, fragments=2, delay=1)
    target.load_state_dict(copy.deepcopy(state))
    for src_model, model in zip(source.models, target.models, strict=True):
        model.load_state_dict(src_model.state_dict())
    assert _same(_snapshot(target, opts), _snapshot(source, source_opts))
    for step in range(6, 12):
        for pair in ((source, source_opts), (target, opts)):
            for rank, (m, o) in enumerate(zip(pair[0].models, pair[1], strict=True)):
                inner_step(m, o, step, rank)
            pair[0].step()
    for a, b in zip(source.models[0].parameters(), target.models[0].parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_version_1_checkpoint_still_loads() -> None:
    source, _ = _trained(4)
    state = round_trip(source.state_dict())
    state["format_version"] = 1
    del state["consecutive_skips"]
    target, _ = _trained(0)
    target.load_state_dict(state)
    assert target.inner_step == 4 and target.consecutive_skips == 0
