"""The one spec grammar (gradzip.spec) and compressor reports."""

from __future__ import annotations

import pytest
import torch

import gradzip
from gradzip import Accordion, Auto, HardThreshold, Schedule, SimulatedGroup, TopK
from gradzip.spec import (
    COMPRESSORS,
    CONTROLLERS,
    REGISTRY,
    compressor_from_spec,
    format_call,
    format_ranges,
    parse_call,
    parse_ranges,
    parse_spec,
    parse_value,
)


def test_values_are_typed_once() -> None:
    assert [parse_value(t) for t in ("3", "-2", "0.5", "1e-3", "inf", "True", "false", "abc")] \
        == [3, -2, 0.5, 1e-3, float("inf"), True, False, "abc"]
    assert parse_spec("topk:ratio=0.1") == ("topk", {"ratio": 0.1})
    assert parse_ranges("0-5;9-12") == [(0, 5), (9, 12)] and format_ranges([(0, 5), (9, 12)]) == "0-5;9-12"


def test_call_form_keys_kinds_and_errors() -> None:
    kinds = {"a": "level", "b": "level", "x": "float", "on": "bool", "r": "ranges"}
    got = parse_call("f(a=topk:ratio=0.1,b=none,x=2,on=true,r=0-3)", "f", kinds, ["a", "b"])
    assert got == {"a": "topk:ratio=0.1", "b": "none", "x": 2.0, "on": True, "r": [(0, 3)]}
    assert format_call("f", {"a": "topk", "x": 2.0}) == "f(a=topk,x=2.0)"
    for text, match in (("g(a=1,b=2)", "must look like 'f\\(a=...,b=...\\)'"),
                        ("f(a=1)", "must give both a= and b="),
                        ("f(y=3,a=1,b=2)", "distinct among"), ("f(a=1,a=2,b=2)", "distinct among"),
                        ("f(a=1,b=2,x=no)", "`x` must be a number"),
                        ("f(a=1,b=2,on=yes)", "`on` must be True or False"),
                        ("f(a=1,b=2,r=0-x)", "must give integer steps")):
        with pytest.raises(ValueError, match=match):
            parse_call(text, "f", kinds, ["a", "b"])


def test_registry_holds_every_compressor_and_controller() -> None:
    assert list(REGISTRY.values()) == list(COMPRESSORS)
    assert CONTROLLERS == {"accordion": Accordion, "schedule": Schedule, "auto": Auto}
    acc = Accordion("topk:ratio=0.01", "none", interval=7)
    assert compressor_from_spec(acc.spec()) == acc == Accordion.parse(acc.spec())


def test_old_names_are_gone() -> None:
    # The pre-release aliases kept after renames were removed: the grammar lives in
    # gradzip.spec only, and a controller is rebuilt from its spec with parse().
    for name in ("REGISTRY", "compressor_from_spec", "describe_compressors", "parse_spec"):
        assert not hasattr(gradzip.compressors, name)
    for cls in (Schedule, Accordion):
        assert not hasattr(cls, "from_spec")
    assert not hasattr(Accordion, "from_specs")
    assert not hasattr(Accordion("topk:ratio=0.01", "none"), "levels_pair")
    sched = Schedule.warmup("topk:ratio=0.1", 3)
    assert Schedule.parse(sched.spec()) == sched


def _run(compressor: gradzip.Compressor, steps: int) -> gradzip.Engine:
    model = torch.nn.Linear(50, 4)
    engine = gradzip.Engine(model, compressor, collective=SimulatedGroup(2))
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        engine.reduce({n: torch.randn(2, *p.shape, generator=gen)
                       for n, p in model.named_parameters()})
    return engine


def test_reports_density_of_plain_compressors_and_controllers() -> None:
    assert TopK(0.1).report({}) == {"density": 0.1}
    assert gradzip.NoCompression().report({}) == {}
    # The all-gather form offers every worker's entries (the sharded one, which ``auto`` may
    # take from a step's counts, offers those outside each worker's own part).
    engine = _run(HardThreshold(budget=0.1, exchange="allgather"), 3)
    sent, offered = HardThreshold(budget=0.1).report(engine.compressor_state)["density_parts"]
    assert offered == 3 * 2 * (50 * 4 + 4) and 0 < sent < offered
    sched = Schedule.warmup("topk:ratio=0.1", 2)
    report = sched.report(_run(sched, 5).compressor_state)
    counts = report["counts"]
    steps = (counts["steady_steps"], counts["critical_steps"])
    assert steps == (6, 4)  # two tensors: 3 steps steady, 2 gentle (dense)
    assert report["density_parts"] == (0.1 * 6 + 1.0 * 4, 10)
    assert set(report["levels"]) == {"weight", "bias"}
    acc = Accordion("threshold:budget=0.1", "threshold:budget=0.5", interval=2)
    report = acc.report(_run(acc, 4).compressor_state)
    sent, offered = report["density_parts"]
    assert offered == 4 * 2 * (50 * 4 + 4) and 0 < sent < offered
