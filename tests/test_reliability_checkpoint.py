"""Checkpoint loads are atomic: everything is validated first, and a refused checkpoint leaves
the engine exactly as it was."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import gradzip
from conformance import SHAPES, make_grads
from gradzip.checkpoint import REQUIRED_KEYS as _REQUIRED

SPEC = "powersgd:rank=2"


def trained(spec: str = SPEC, shapes: dict[str, torch.Size] = SHAPES, steps: int = 2) -> gradzip.Engine:
    engine = gradzip.Engine(shapes, spec, collective=gradzip.SimulatedGroup(2))
    for step in range(steps):
        grads = make_grads(2, step)
        engine.reduce({n: grads[n] for n in shapes})
    return engine


def same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def refused(engine: gradzip.Engine, state: dict[str, Any], fragment: str) -> None:
    """``load_state_dict(state)`` raises ValueError mentioning ``fragment`` and changes nothing."""
    before = engine.state_dict()
    with pytest.raises(ValueError) as info:
        engine.load_state_dict(state)
    assert fragment in str(info.value), str(info.value)
    assert same(engine.state_dict(), before)


@pytest.mark.parametrize("key", _REQUIRED)
def test_a_missing_key_is_named_and_nothing_changes(key: str) -> None:
    source, target = trained(steps=3), trained(steps=1)
    state = source.state_dict()
    del state[key]
    refused(target, state, f"`{key}`")


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(state: dict[str, Any]) -> None:
        *parents, last = path.split("/")
        node = state
        for part in parents:
            node = node[part]
        node[last] = value(node[last]) if callable(value) else value
    return change


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (_set("step", -1), "`step` of the checkpoint must be an integer >= 0, got -1"),
        (_set("step", 2.5), "`step` of the checkpoint must be an integer >= 0, got 2.5"),
        (_set("step", "3"), "`step`"),
        (_set("step", True), "`step`"),
        (_set("skipped_steps", 99), "`skipped_steps` of the checkpoint must be <= step"),
        (_set("residual_scale", 0.0), "`residual_scale`"),
        (_set("residual_scale", "x"), "`residual_scale`"),
        (_set("residual_scale", float("nan")), "`residual_scale`"),
        (_set("residuals/fc.weight", lambda r: r.double()), "must be float32, got torch.float64"),
        (_set("residuals/fc.weight", lambda r: r.fill_(float("nan"))), "residual 'fc.weight' of the checkpoint holds NaN"),
        (_set("residuals/fc.weight", "zeros"), "residual 'fc.weight' must match"),
        (_set("residuals", []), "`residuals` of the checkpoint must be a dict"),
        (_set("compressor_state/q/fc.weight", lambda q: q.clone().fill_(float("inf"))), "compressor_state.q.fc.weight: holds NaN or Inf"),
        (_set("compressor_state/q/fc.weight", lambda q: q.double()), "compressor_state.q.fc.weight: expected dtype torch.float32"),
        (_set("meter/payload", [1]), "`meter.payload` of the checkpoint must list 2 integers >= 0"),
        (_set("meter/wire", [-1, 0]), "`meter.wire`"),
        (_set("meter/calls", 1.5), "`meter.calls`"),
        (_set("dense_payload", [0, "a"]), "`dense_payload`"),
        (_set("dense_wire", None), "`dense_wire`"),
        (_set("world_size", 3), "`world_size` of the checkpoint must be 2, got 3"),
        (_set("error_feedback", 1), "`error_feedback` of the checkpoint must be True, got 1"),
    ],
)
def test_bad_values_are_refused_and_nothing_changes(change: Callable[[dict[str, Any]], None], fragment: str) -> None:
    source, target = trained(steps=3), trained(steps=1)
    state = copy.deepcopy(source.state_dict())
    change(state)
    refused(target, state, fragment)


@pytest.mark.parametrize("spec, counter", [("threshold:budget=0.05", "expected an integer"),
                                           ("threshold:budget=0.05,capacity=0.1", "expected a tensor")])
def test_bad_scalars_in_the_compressor_state_are_refused(spec: str, counter: str) -> None:
    source, target = trained(spec, steps=3), trained(spec)
    number = "expected a number" if counter == "expected an integer" else counter
    for key, value, fragment in (("lam", "abc", "expected a number"), ("lam", float("nan"), "holds NaN"),
                                 ("sent", 1.5, counter), ("sent", None, number)):
        state = copy.deepcopy(source.state_dict())
        state["compressor_state"][key] = value
        refused(target, state, f"compressor_state.{key}: {fragment}")


def test_a_checkpoint_with_a_nan_warm_start_is_refused_by_name() -> None:
    """It would otherwise make every later step NaN on every rank."""
    state = trained(steps=2).state_dict()
    state["compressor_state"]["q"]["conv.weight"][0, 0] = float("nan")
    refused(trained(steps=1), state, "compressor_state.q.conv.weight: holds NaN or Inf")


def test_another_parameter_set_is_refused_in_both_directions() -> None:
    small = {n: s for n, s in SHAPES.items() if n != "fc.weight"}
    for spec in ("topk:ratio=0.05", SPEC):
        big_engine, small_engine = trained(spec, SHAPES, 1), trained(spec, small, 1)
        # Checkpoint of the big model into the small engine: an extra name (its residual first).
        refused(small_engine, big_engine.state_dict(), "'fc.weight'")
        # Checkpoint of the small model into the big engine: a missing name.
        refused(big_engine, small_engine.state_dict(), "checkpoint lacks parameter 'fc.weight'")
    # Before any step no residual exists: the stored parameter set still tells them apart.
    fresh_big = gradzip.Engine(SHAPES, "topk:ratio=0.05", collective=gradzip.SimulatedGroup(2))
    fresh_small = gradzip.Engine(small, "topk:ratio=0.05", collective=gradzip.SimulatedGroup(2))
    refused(fresh_small, fresh_big.state_dict(), "checkpoint holds parameter 'fc.weight'")
    refused(fresh_big, fresh_small.state_dict(), "checkpoint lacks parameter 'fc.weight'")


def test_a_valid_checkpoint_round_trips_and_continues_identically() -> None:
    source = trained(steps=3)
    target = trained(steps=1)
    target.load_state_dict(copy.deepcopy(source.state_dict()))
    assert same(target.state_dict(), source.state_dict())
    a, b = source.reduce(make_grads(2, 5)), target.reduce(make_grads(2, 5))
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_checkpoints_without_the_optional_keys_still_load() -> None:
    """``dense_1d``, ``residual_scale`` and ``parameters`` came later: older checkpoints lack them."""
    state = trained(steps=2).state_dict()
    for key in ("dense_1d", "residual_scale", "parameters"):
        del state[key]
    target = trained(steps=1)
    target.load_state_dict(state)
    assert target.step == 2


def test_state_dict_works_after_a_raise_inside_a_step() -> None:
    engine = gradzip.Engine(SHAPES, "topk:ratio=0.05", collective=gradzip.SimulatedGroup(2),
                            nonfinite="raise")
    engine.reduce(make_grads(2, 0))
    before = engine.state_dict()
    bad = make_grads(2, 1)
    engine.reduce({"conv.weight": bad["conv.weight"]}, finish_step=False)
    bad["fc.weight"][0, 0, 0] = float("nan")
    with pytest.raises(FloatingPointError):
        engine.reduce({"fc.weight": bad["fc.weight"]})
    after = engine.state_dict()
    # The step is abandoned: state as before it. Byte counters keep what was really sent.
    for key in ("step", "skipped_steps", "residuals", "compressor_state"):
        assert same(after[key], before[key]), key
    assert after["meter"]["calls"] > before["meter"]["calls"]
