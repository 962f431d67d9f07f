"""The one options record: validation, keyword routing, the same behaviour whichever way the
options are given, and the entry points that share it."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import gradzip
import gradzip.ddp
from gradzip import Engine, EngineOptions, SimulatedGroup
from gradzip.engine import STATS_KEYS
from gradzip.integrations._common import ENGINE_OPTIONS, split_engine_options, with_optimizer

SHAPES = {"w": torch.Size((8, 6)), "b": torch.Size((8,))}


def _grads(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return {n: torch.randn((3, *s), generator=gen) for n, s in SHAPES.items()}


def test_the_record_is_frozen_validated_and_comparable() -> None:
    options = EngineOptions(dense_1d=True, rules=[("w", "sign")], min_numel=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.dense_1d = False  # type: ignore[misc]
    assert options == EngineOptions(dense_1d=True, rules=["w=sign"], min_numel=3)
    assert hash(options) == hash(EngineOptions(dense_1d=True, rules=["w=sign"], min_numel=3))
    assert EngineOptions.names() == (
        "error_feedback", "nonfinite", "optimizer", "grad_scaler", "dense_1d", "rules", "min_numel")


@pytest.mark.parametrize(
    ("kwargs", "exc", "fragment"),
    [
        ({"error_feedback": 1}, TypeError, "`error_feedback` must be a bool or None, got 1"),
        ({"nonfinite": "ignore"}, ValueError, "`nonfinite` must be one of"),
        ({"optimizer": "sgd"}, TypeError, "`optimizer` must be a torch.optim.Optimizer"),
        ({"grad_scaler": 2.0}, TypeError, "`grad_scaler` must be a torch.amp.GradScaler"),
        ({"dense_1d": "yes"}, TypeError, "`dense_1d` must be a bool"),
        ({"min_numel": 1.5}, TypeError, "`min_numel` must be an integer"),
    ],
)
def test_invalid_options_are_named(kwargs: dict, exc: type, fragment: str) -> None:
    with pytest.raises(exc, match=fragment):
        EngineOptions(**kwargs)
    with pytest.raises(exc, match=fragment):  # the same check through an entry point
        Engine(SHAPES, "sign", collective=SimulatedGroup(3), **kwargs)


def test_unknown_keywords_are_a_type_error_naming_them() -> None:
    model = torch.nn.Linear(3, 2)
    for call in (
        lambda: Engine(SHAPES, "sign", collective=SimulatedGroup(3), dense1d=True),
        lambda: gradzip.ddp.make_hook(model, "sign", dense1d=True),
        lambda: gradzip.ddp.GradzipHookState(model.named_parameters(), "sign", dense1d=True),
        lambda: EngineOptions.build(None, dense1d=True),
    ):
        with pytest.raises(TypeError, match="unexpected keyword argument 'dense1d'"):
            call()
    with pytest.raises(TypeError, match="`options` must be a gradzip.EngineOptions, got dict"):
        Engine(SHAPES, "sign", collective=SimulatedGroup(3), options={"dense_1d": True})


def test_keywords_replace_the_records_fields() -> None:
    base = EngineOptions(dense_1d=True, nonfinite="zero")
    built = EngineOptions.build(base, nonfinite="raise", min_numel=4)
    assert built == EngineOptions(dense_1d=True, nonfinite="raise", min_numel=4)
    assert EngineOptions.build(base) is base
    engine = Engine(SHAPES, "sign", collective=SimulatedGroup(3), options=base, nonfinite="raise")
    assert engine.options.nonfinite == "raise" and engine.nonfinite == "raise"
    assert engine.dense_1d is True


@pytest.mark.parametrize("spec", ["topk:ratio=0.3", "powersgd:rank=1", "qsgd"])
def test_a_record_and_keywords_give_bit_identical_results(spec: str) -> None:
    by_keywords = Engine(SHAPES, spec, collective=SimulatedGroup(3), dense_1d=True,
                         error_feedback=True)
    by_record = Engine(SHAPES, spec, collective=SimulatedGroup(3),
                       options=EngineOptions(dense_1d=True, error_feedback=True))
    for step in range(3):
        a, b = by_keywords.reduce(_grads(step)), by_record.reduce(_grads(step))
        assert all(torch.equal(a[n], b[n]) for n in SHAPES)
    assert by_keywords.stats == by_record.stats
    assert by_keywords.state_dict().keys() == by_record.state_dict().keys()


def test_hook_state_takes_the_record_whole_and_its_stats_keys_never_change() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    options = EngineOptions(optimizer=opt, dense_1d=True, rules=[("weight", "sign")])
    state, hook = gradzip.ddp.make_hook(model, "topk:ratio=0.5", options=options)
    assert hook is gradzip.ddp.gradzip_hook
    assert state.options == options
    assert (state.optimizer, state.dense_1d, state.error_feedback, state.nonfinite) == (
        opt, True, None, "skip")
    # Before the first step (no engine yet): the same keys as afterwards.
    assert set(state.stats) == {*STATS_KEYS, "compression_rate", "levels"}
    engine = Engine(SHAPES, "sign", collective=SimulatedGroup(3))
    assert tuple(engine.stats) == STATS_KEYS


def test_entry_point_signatures_share_the_record() -> None:
    for fn in (Engine.__init__, gradzip.ddp.GradzipHookState.__init__, gradzip.ddp.make_hook,
               gradzip.ddp.register):
        params = inspect.signature(fn).parameters
        assert "options" in params and params["options"].default is None
        assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        assert not set(EngineOptions.names()) & set(params), fn  # no copied keyword lists


def test_integrations_route_the_records_fields() -> None:
    assert frozenset(EngineOptions.names()) | {"options", "overlap", "fuse_buckets"} == \
        ENGINE_OPTIONS
    engine, other = split_engine_options(
        {"rules": [("*.bias", "dense")], "min_numel": 8, "bucket_cap_mb": 1.0,
         "fuse_buckets": True}, "Strategy")
    assert engine == {"rules": [("*.bias", "dense")], "min_numel": 8, "fuse_buckets": True}
    with pytest.raises(TypeError, match="`fuse_buckets` must be a bool, got"):
        split_engine_options({"fuse_buckets": "yes"}, "Strategy")
    assert other == {"bucket_cap_mb": 1.0}
    with pytest.raises(ValueError, match="`min_numel` must be >= 0, got -2"):
        split_engine_options({"min_numel": -2}, "Strategy")
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    assert with_optimizer({}, opt) == {"optimizer": opt}
    mine = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    record = EngineOptions(optimizer=mine)
    assert with_optimizer({"options": record}, opt) == {"options": record}  # the user's stays
    assert with_optimizer({"optimizer": None}, opt) == {"optimizer": None}
