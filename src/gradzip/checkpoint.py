"""Validation of an engine checkpoint: everything is checked before anything is changed.

:func:`validate_checkpoint` returns the parsed values or raises naming the first problem, so
``Engine.load_state_dict`` either swaps in a whole valid state or leaves the engine untouched.
A checkpoint holding NaN or Inf is refused rather than loaded: a non-finite warm start or
residual would make every later step non-finite on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Real
from typing import TYPE_CHECKING, Any

import torch

from gradzip.ops.finite import all_finite
from gradzip.options import MAIN_ROUTE
from gradzip.statecheck import check_tree, nonneg_int

if TYPE_CHECKING:
    from gradzip.engine.routing import Router

__all__ = ["REQUIRED_KEYS", "Loaded", "validate_checkpoint"]

# Optional configuration keys and the value an older checkpoint that lacks them stands for.
_OPTIONAL: dict[str, Any] = {"dense_1d": False, "rules": [], "min_numel": 0}

# Keys every checkpoint holds (``dense_1d``, ``rules``, ``min_numel``, ``rule_states``,
# ``residual_scale`` and ``parameters`` are optional: older checkpoints lack them).
REQUIRED_KEYS = (
    "format_version", "compressor", "error_feedback", "world_size", "ranks", "step",
    "skipped_steps", "residuals", "compressor_state", "meter", "dense_payload", "dense_wire",
)


@dataclass
class Loaded:
    """The validated content of a checkpoint, ready to be swapped in."""

    step: int
    skipped_steps: int
    residual_scale: float | None
    residuals: dict[str, torch.Tensor]
    compressor_state: Any
    rule_states: list[Any]
    meter: dict[str, Any]
    dense_payload: list[int]
    dense_wire: list[int]


def validate_checkpoint(
    state: Any,
    *,
    config: Mapping[str, Any],
    shapes: Mapping[str, torch.Size],
    dense_names: frozenset[str],
    workers: int,
    fresh_state: Any,
    feedback_names: frozenset[str] | None = None,
    fresh_rule_states: list[Any] | None = None,
    router: Router | None = None,
) -> Loaded:
    """Check a checkpoint against the engine that loads it.

    Args:
        state: what ``Engine.state_dict`` returned (possibly saved and loaded).
        config: values the checkpoint must hold exactly (``format_version``, ``compressor``,
            ``error_feedback``, ``dense_1d``, ``rules``, ``min_numel``, ``world_size``,
            ``ranks``).
        shapes: the engine's parameters.
        dense_names: parameters sent dense (they have no residual).
        workers: local workers of the engine (the residuals' leading axis).
        fresh_state: the compressor's ``init_state``, the reference for structure, shapes,
            dtypes and kinds of values.
        feedback_names: parameters that keep a residual (default: every one not sent dense
            when ``config["error_feedback"]``, none otherwise).
        fresh_rule_states: each rule's fresh state, the reference for ``rule_states``.
        router: the engine's routes; when given, each compressor checks the values of its
            loaded state (``Compressor.check_state``: ranges, names, consistency).

    Returns:
        The parsed values (residuals cloned).

    Raises:
        TypeError: ``state`` is not a mapping.
        ValueError: the first problem found, naming the key.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"`state` must be a mapping, got {type(state).__name__}")
    for key in REQUIRED_KEYS:
        if key not in state:
            raise ValueError(f"checkpoint must hold `{key}`, but the key is missing")
    if state["format_version"] != config["format_version"]:
        raise ValueError(
            f"`format_version` must be {config['format_version']}, got {state['format_version']!r}"
        )
    for key, want in config.items():
        got = state.get(key, _OPTIONAL.get(key))  # older checkpoints lack the optional keys
        if got != want or type(got) is not type(want):
            raise ValueError(f"`{key}` of the checkpoint must be {want!r}, got {got!r}")
    step, skipped = state["step"], state["skipped_steps"]
    for key, value in (("step", step), ("skipped_steps", skipped)):
        if not nonneg_int(value):
            raise ValueError(f"`{key}` of the checkpoint must be an integer >= 0, got {value!r}")
    if skipped > step:
        raise ValueError(f"`skipped_steps` of the checkpoint must be <= step ({step}), got {skipped}")
    scale = state.get("residual_scale")
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, Real) or not 0 < float(scale) < math.inf
    ):
        raise ValueError(f"`residual_scale` of the checkpoint must be None or > 0, got {scale!r}")
    if feedback_names is None:
        feedback_names = frozenset(shapes) - dense_names if config["error_feedback"] else frozenset()
    residuals = _residuals(state["residuals"], shapes, dense_names, workers, feedback_names)
    if "parameters" in state:  # absent from older checkpoints
        _parameters(state["parameters"], shapes)
    compressor_state = state["compressor_state"]
    if router is not None:  # an earlier version's layout, brought to this one's
        compressor_state = router.compressor.upgrade_state(
            compressor_state, fresh=fresh_state, step=int(step))
    mismatch = check_tree(fresh_state, compressor_state, "compressor_state")
    if mismatch:
        raise ValueError(f"checkpoint does not match this engine: {mismatch}")
    rule_states = _rule_states(state.get("rule_states", []), fresh_rule_states or [])
    _residual_set(state.get("without_residual"), residuals, feedback_names)
    if router is not None:
        _check_values(router, compressor_state, fresh_state, rule_states,
                      fresh_rule_states or [], workers)
    meter = state["meter"]
    counters = {"dense_payload": state["dense_payload"], "dense_wire": state["dense_wire"]}
    if isinstance(meter, Mapping):
        counters.update({f"meter.{k}": meter.get(k) for k in ("payload", "wire")})
    for key, value in counters.items():
        if not isinstance(value, (list, tuple)) or len(value) != workers or not all(
            nonneg_int(v) for v in value
        ):
            raise ValueError(f"`{key}` of the checkpoint must list {workers} integers >= 0, got {value!r}")
    if not isinstance(meter, Mapping) or not nonneg_int(meter.get("calls")):
        raise ValueError(f"`meter.calls` of the checkpoint must be an integer >= 0, got {meter!r}")
    return Loaded(
        step=int(step),
        skipped_steps=int(skipped),
        residual_scale=None if scale is None else float(scale),
        residuals=residuals,
        compressor_state=compressor_state,
        rule_states=rule_states,
        meter={"payload": [int(v) for v in meter["payload"]], "wire": [int(v) for v in meter["wire"]],
               "calls": int(meter["calls"])},
        dense_payload=[int(v) for v in state["dense_payload"]],
        dense_wire=[int(v) for v in state["dense_wire"]],
    )


def _check_values(router: Router, main: Any, fresh_main: Any, rules: list[Any],
                  fresh_rules: list[Any], workers: int) -> None:
    """Each compressor's check of its own state's values, once the structure is known good."""
    checks = [(MAIN_ROUTE, router.compressor, main, fresh_main, "compressor_state")]
    checks += [(i + 1, c, got, want, f"rule_states[{i}]") for i, (c, got, want) in
               enumerate(zip(router.rule_compressors, rules, fresh_rules, strict=True)) if c]
    for where, compressor, got, want, path in checks:
        found = compressor.check_state(got, fresh=want, shapes=router.shapes_of(where),
                                       workers=workers)
        if found:
            raise ValueError(f"checkpoint holds a value this engine cannot continue from: {path}.{found}")


def _residual_set(listed: Any, residuals: Mapping[str, torch.Tensor],
                  feedback_names: frozenset[str]) -> None:
    """Every parameter that keeps a residual either has one or is listed without one.

    A parameter the engine has not reduced yet (or whose only calls were rolled back) has no
    residual; ``state_dict`` lists those, so a residual dropped from the file is told apart
    from one never made (loading without it would silently discard that parameter's error).
    Checkpoints of earlier versions, without the list, are not checked.
    """
    if listed is None:
        return
    if not isinstance(listed, (list, tuple)) or not all(isinstance(n, str) for n in listed):
        raise ValueError(f"`without_residual` of the checkpoint must list parameter names, got {listed!r}")
    for name in listed:
        if name not in feedback_names or name in residuals:
            why = "it has a residual" if name in residuals else "it keeps no residual in this engine"
            raise ValueError(f"`without_residual` of the checkpoint must not list {name!r}: {why}")
    for name in sorted(feedback_names):
        if name not in residuals and name not in listed:
            raise ValueError(
                f"checkpoint lacks the residual of parameter {name!r}, which it does not list "
                f"among the parameters without one (`without_residual`)"
            )


def _rule_states(saved: Any, fresh: list[Any]) -> list[Any]:
    """Each rule's compressor state against its fresh one (structure, shapes, dtypes)."""
    if not isinstance(saved, list) or len(saved) != len(fresh):
        got = len(saved) if isinstance(saved, list) else type(saved).__name__
        raise ValueError(f"`rule_states` of the checkpoint must list {len(fresh)} states, got {got}")
    for i, (want, got) in enumerate(zip(fresh, saved, strict=True)):
        mismatch = check_tree(want, got, f"rule_states[{i}]")
        if mismatch:
            raise ValueError(f"checkpoint does not match this engine: {mismatch}")
    return list(saved)


def _residuals(
    residuals: Any, shapes: Mapping[str, torch.Size], dense_names: frozenset[str], workers: int,
    feedback_names: frozenset[str],
) -> dict[str, torch.Tensor]:
    if not isinstance(residuals, Mapping):
        raise ValueError(f"`residuals` of the checkpoint must be a dict, got {type(residuals).__name__}")
    if residuals and not feedback_names:
        raise ValueError(
            f"`residuals` of the checkpoint must be empty without error feedback, got "
            f"{sorted(map(str, residuals))[:3]}"
        )
    out = {}
    for name, res in residuals.items():
        expected = torch.Size((workers, *shapes.get(name, ())))
        if not isinstance(res, torch.Tensor) or name not in shapes or res.shape != expected:
            got = tuple(res.shape) if isinstance(res, torch.Tensor) else type(res).__name__
            raise ValueError(f"residual {name!r} must match a parameter of shape {tuple(expected)}, got {got}")
        if name in dense_names:
            raise ValueError(
                f"residual {name!r} must be absent: it is sent dense (`dense_1d`, a dense rule "
                f"or `min_numel`)"
            )
        if name not in feedback_names:
            raise ValueError(
                f"residual {name!r} must be absent: its compressor runs without error feedback"
            )
        if res.dtype != torch.float32:
            raise ValueError(f"residual {name!r} must be float32, got {res.dtype}")
        if not all_finite([res]):
            raise ValueError(f"residual {name!r} of the checkpoint holds NaN or Inf")
        out[name] = res.clone()
    return out


def _parameters(saved: Any, shapes: Mapping[str, torch.Size]) -> None:
    """The stored parameter set against the engine's: the first missing or extra name."""
    if not isinstance(saved, Mapping):
        raise ValueError(f"`parameters` of the checkpoint must be a dict, got {type(saved).__name__}")
    for name, shape in shapes.items():
        if name not in saved:
            raise ValueError(
                f"checkpoint lacks parameter {name!r} of this engine: it was saved from another "
                f"parameter set"
            )
        if not isinstance(saved[name], (list, tuple)) or list(saved[name]) != list(shape):
            raise ValueError(
                f"parameter {name!r} must have shape {list(shape)} in the checkpoint, got {saved[name]!r}"
            )
    for name in saved:
        if name not in shapes:
            raise ValueError(
                f"checkpoint holds parameter {name!r}, which this engine does not have: it was "
                f"saved from another parameter set"
            )
