"""The outer loop's checkpoints: its state as plain data, and an all-or-nothing load.

:meth:`Outer.load_state_dict <gradzip.Outer.load_state_dict>` validates every part (the
anchor, the outer optimizer's state, the exchange in flight, the counters, the inner
optimizers' states; the engine's part is validated by :meth:`Engine.load_state_dict
<gradzip.Engine.load_state_dict>`, itself all-or-nothing) before anything changes, and puts
the engine and the inner optimizers back as they were when a later part is refused: a
refused checkpoint leaves the outer loop exactly as it was. A checkpoint holding NaN or Inf
anywhere is refused (a non-finite exchange in flight would turn every parameter non-finite
at its due step).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from gradzip.outer.optim import OuterOptimizer
from gradzip.statecheck import check_tree, first_nonfinite, nonneg_int

__all__ = ["FORMAT_VERSION", "load_state", "save_state"]

#: 2: ``consecutive_skips`` added (a version-1 checkpoint stands for 0).
FORMAT_VERSION = 2

_REQUIRED = ("format_version", "config", "inner_step", "syncs", "skipped_syncs", "anchor",
             "outer_state", "pending", "engine", "inner_optimizers")


def save_state(outer: Any) -> dict[str, Any]:
    """:meth:`Outer.state_dict <gradzip.Outer.state_dict>` (an exchange in flight already
    settled)."""
    pending = None
    if outer.pending is not None:
        fragment, due, averaged = outer.pending
        pending = {"fragment": fragment, "due": due,
                   "averaged": None if averaged is None else {n: t.clone() for n, t in averaged.items()}}
    return {
        "format_version": FORMAT_VERSION,
        "config": outer.checkpoint_config(),
        "inner_step": outer.inner_step,
        "syncs": outer.syncs,
        "skipped_syncs": outer.skipped_syncs,
        "consecutive_skips": outer.consecutive_skips,
        "anchor": {n: t.clone() for n, t in outer.anchor.items()},
        "outer_state": {n: t.clone() for n, t in outer.outer_state.items()},
        "pending": pending,
        "engine": outer.engine.state_dict(),
        "inner_optimizers": [o.state_dict() for o in outer.inner_optimizers],
    }


def _refuse(problem: str) -> ValueError:
    return ValueError(f"`state` must be an Outer checkpoint of this configuration: {problem}")


def _counters(outer: Any, state: Mapping[str, Any]) -> tuple[int, int, int, int]:
    """``(inner_step, syncs, skipped_syncs, consecutive_skips)``, consistent with the plan."""
    values = [state["inner_step"], state["syncs"], state["skipped_syncs"],
              state.get("consecutive_skips", 0)]
    names = ("inner_step", "syncs", "skipped_syncs", "consecutive_skips")
    for name, value in zip(names, values, strict=True):
        if not nonneg_int(value):
            raise _refuse(f"`{name}` must be an integer >= 0, got {value!r}")
    inner, syncs, skipped, consecutive = (int(v) for v in values)
    # One exchange is sent every `period` inner steps, counted whether or not it was skipped.
    if syncs != inner // outer.plan.period:
        raise _refuse(f"`syncs` must be {inner // outer.plan.period} after {inner} inner steps "
                      f"(one every {outer.plan.period}), got {syncs}")
    if not consecutive <= skipped <= syncs:
        raise _refuse("the counters must satisfy consecutive_skips <= skipped_syncs <= syncs, "
                      f"got {consecutive}, {skipped}, {syncs}")
    return inner, syncs, skipped, consecutive


def _pending(outer: Any, saved: Any, inner: int) -> tuple[int, int, dict[str, torch.Tensor] | None] | None:
    """The exchange in flight: present exactly when the plan says one is, with finite
    averages of its fragment's tensors."""
    plan = outer.plan
    sent = inner - inner % plan.period
    expected = sent if plan.delay and sent >= plan.period and inner < sent + plan.delay else None
    if expected is None:
        if saved is not None:
            raise _refuse(f"`pending` must be None at inner step {inner}, got an exchange")
        return None
    if not isinstance(saved, Mapping) or set(saved) != {"fragment", "due", "averaged"}:
        raise _refuse(f"`pending` must hold fragment, due and averaged at inner step {inner}, got {saved!r}")
    fragment, due = plan.sent_after(expected), expected + plan.delay
    if (saved["fragment"], saved["due"]) != (fragment, due):
        raise _refuse(f"`pending` must be fragment {fragment} due at step {due}, got fragment "
                      f"{saved['fragment']!r} due at {saved['due']!r}")
    averaged = saved["averaged"]
    if averaged is None:
        return fragment, due, None
    want = {n: outer.anchor[n] for n in outer.fragments[fragment]}
    problem = check_tree(want, averaged, "pending.averaged")
    if problem:
        raise _refuse(problem)
    return fragment, due, {n: averaged[n].clone() for n in want}


def _outer_state(outer: Any, saved: Any) -> dict[str, torch.Tensor]:
    if not isinstance(saved, Mapping):
        raise _refuse(f"`outer_state` must be a dict, got {type(saved).__name__}")
    if not outer.optimizer.momentum and saved:
        raise _refuse(f"`outer_state` must be empty for {outer.optimizer.describe()}, got {sorted(saved)}")
    unknown = sorted(set(saved) - set(outer.names))
    if unknown:
        raise _refuse(f"`outer_state` holds unknown tensors {unknown[:3]}")
    problem = check_tree({n: outer.anchor[n] for n in saved}, saved, "outer_state")
    if problem:
        raise _refuse(problem)
    return dict(saved)


def _check_optimizer_state(opt: torch.optim.Optimizer, saved: Any) -> str | None:
    """The first problem of ``saved`` as ``opt``'s state dict (torch checks the groups' sizes
    when it loads, not the state's shapes or values), or ``None``."""
    if not isinstance(saved, Mapping) or not {"state", "param_groups"} <= set(saved):
        return "expected a dict with `state` and `param_groups`"
    groups = saved["param_groups"]
    mine = opt.param_groups
    if not isinstance(groups, (list, tuple)) or len(groups) != len(mine):
        return f"expected {len(mine)} parameter groups"
    params: dict[Any, torch.Tensor] = {}
    for i, (group, own) in enumerate(zip(groups, mine, strict=True)):
        ids = group.get("params") if isinstance(group, Mapping) else None
        if not isinstance(ids, (list, tuple)) or len(ids) != len(own["params"]):
            return f"parameter group {i} must hold {len(own['params'])} parameters"
        params.update(zip(ids, own["params"], strict=True))
    per_param = saved["state"]
    if not isinstance(per_param, Mapping) or not set(per_param) <= set(params):
        return "its `state` must be keyed by the groups' parameters"
    for key, values in per_param.items():
        if not isinstance(values, Mapping):
            return f"state of parameter {key!r} must be a dict"
        for field, value in values.items():
            if isinstance(value, torch.Tensor) and value.numel() > 1 and value.shape != params[key].shape:
                return (f"state `{field}` of parameter {key!r} must have shape "
                        f"{tuple(params[key].shape)}, got {tuple(value.shape)}")
    found = first_nonfinite(dict(per_param), "state")
    return f"{found} holds NaN or Inf" if found else None


def _check_inner(outer: Any, saved: Any) -> list[Any]:
    if not isinstance(saved, (list, tuple)) or len(saved) != len(outer.inner_optimizers):
        got = len(saved) if isinstance(saved, (list, tuple)) else type(saved).__name__
        raise _refuse(f"`inner_optimizers` must hold {len(outer.inner_optimizers)} inner "
                      f"optimizer states, got {got}")
    for i, (opt, opt_state) in enumerate(zip(outer.inner_optimizers, saved, strict=True)):
        problem = _check_optimizer_state(opt, opt_state)
        if problem:
            raise _refuse(f"inner optimizer {i}: {problem}")
    return list(saved)


def load_state(outer: Any, state: Any) -> None:
    """:meth:`Outer.load_state_dict <gradzip.Outer.load_state_dict>` (an exchange in flight
    already settled): everything or nothing.

    Raises:
        TypeError: ``state`` is not a mapping.
        ValueError: the first problem found, named.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"`state` must be a mapping, got {type(state).__name__}")
    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        raise _refuse(f"missing keys {missing}")
    if state["format_version"] not in (1, FORMAT_VERSION):
        raise ValueError(f"`state` must have format_version 1 or {FORMAT_VERSION}, got {state['format_version']!r}")
    config = state["config"]
    if not isinstance(config, Mapping) or dict(config) != outer.checkpoint_config():
        raise ValueError(f"`state` must come from the same outer configuration "
                         f"{outer.checkpoint_config()}, got {config!r}")
    inner, syncs, skipped, consecutive = _counters(outer, state)
    problem = check_tree(outer.anchor, state["anchor"], "anchor")
    if problem:
        raise _refuse(problem)
    outer_state = _outer_state(outer, state["outer_state"])
    pending = _pending(outer, state["pending"], inner)
    inner_states = _check_inner(outer, state["inner_optimizers"])
    # Everything of the outer loop's own is valid. The engine validates its part and loads
    # it atomically; the inner optimizers' loads can still refuse (torch's own checks), so
    # what they and the engine held is kept to put back.
    engine_before = outer.engine.state_dict()
    optimizers_before = [copy.deepcopy(o.state_dict()) for o in outer.inner_optimizers]
    outer.engine.load_state_dict(state["engine"])
    try:
        for opt, opt_state in zip(outer.inner_optimizers, inner_states, strict=True):
            opt.load_state_dict(opt_state)
    except Exception as err:
        outer.engine.load_state_dict(engine_before)
        for opt, before in zip(outer.inner_optimizers, optimizers_before, strict=True):
            opt.load_state_dict(before)
        raise _refuse(f"an inner optimizer refused its state ({err})") from err
    home = torch.device("cpu") if outer.offload else outer.device
    outer.anchor = {n: state["anchor"][n].to(home, copy=True) for n in outer.names}
    outer.outer_state = OuterOptimizer.state_to(outer_state, home)
    outer.inner_step, outer.syncs, outer.skipped_syncs = inner, syncs, skipped
    outer.consecutive_skips = consecutive
    outer.pending = pending
