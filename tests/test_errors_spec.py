"""Spec text at its edges: aliases given twice, numbers written unusually, whitespace, and
errors inside a controller's levels."""

from __future__ import annotations

import pytest
import torch

import gradzip
from gradzip.spec import parse_level_schedule, parse_spec

ACC = "accordion(steady=topk:ratio=0.01,critical=topk:ratio=0.1{})"


@pytest.mark.parametrize(
    ("spec", "exc", "message"),
    [
        ("powersgd:rank=1,matrix_rank=2", ValueError,
         "`powersgd` must give 'matrix_rank' once (under one of its names), got both 'rank' "
         "and 'matrix_rank' in 'powersgd:rank=1,matrix_rank=2'"),
        ("powersgd:matrix_rank=2,rank=1", ValueError,
         "`powersgd` must give 'matrix_rank' once (under one of its names), got both "
         "'matrix_rank' and 'rank' in 'powersgd:matrix_rank=2,rank=1'"),
        ("qsgd:levels=\uff11\uff12", ValueError,
         "`levels` must be written with ASCII digits, got '\uff11\uff12'"),
        ("topk:ratio=\u0660.\u0661", ValueError,
         "`ratio` must be written with ASCII digits, got '\u0660.\u0661'"),
        ("topk:ratio=1e-400", ValueError,
         "`ratio` must be within a float's range (it would round to 0.0), got '1e-400'"),
        ("topk:ratio=-1e400", ValueError,
         "`ratio` must be within a float's range (it would round to -inf), got '-1e400'"),
        ("qsgd:levels=1.5", TypeError, "`levels` must be an integer, got 1.5"),
        (ACC.format(",interval=\uff11\uff10"), ValueError,
         "`interval` must be written with ASCII digits, got '\uff11\uff10'"),
        (ACC.format(",eta=1e-400"), ValueError,
         "`eta` must be within a float's range (it would round to 0.0), got '1e-400'"),
        (ACC.format(",interval=1.5e0"), ValueError, "`interval` must be an integer, got '1.5e0'"),
        (ACC.format(",interval=1e999999999"), ValueError,
         "`interval` must be an integer, got '1e999999999'"),
        ("accordion(steady=topk:ratio=2,critical=topk:ratio=0.1)", ValueError,
         "`steady` of Accordion ('topk:ratio=2'): `ratio` must be in (0, 1], got 2.0"),
        ("accordion(steady=topk:ratio=0.01,critical=zip)", ValueError,
         "`critical` of Accordion ('zip'): `spec` must name one of"),
        ("accordion(steady=topk:ratio=0.01,critical=accordion(steady=topk:ratio=0.1,"
         "critical=topk:ratio=0.2))", TypeError,
         "`critical` must be a plain compressor, not a Accordion"),
    ],
)
def test_spec_text_refused_naming_the_part(spec: str, exc: type, message: str) -> None:
    with pytest.raises(exc) as info:
        gradzip.compressor_from_spec(spec)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("spec", "same_as"),
    [
        ("powersgd:rank=1e0", "powersgd:rank=1"),
        ("qsgd:levels=1e1", "qsgd:levels=10"),
        (ACC.format(",interval=1e3"), ACC.format(",interval=1000")),
        (ACC.format(",interval=2.5e2"), ACC.format(",interval=250")),
        ("topk : ratio = 0.1", "topk:ratio=0.1"),
        (" topk:ratio=0.1 , ", None),
        ("  qsgd :levels= 4,bucket_size =16 ", "qsgd:levels=4,bucket_size=16"),
        ("accordion ( steady = topk : ratio=0.01 , critical = topk:ratio = 0.1 , interval = 7 )",
         ACC.format(",interval=7")),
        ("topk:ratio=1e-300", "topk:ratio=1e-300"),
    ],
)
def test_spec_whitespace_and_integral_exponents(spec: str, same_as: str | None) -> None:
    if same_as is None:  # a trailing comma is an empty parameter, with or without spaces
        with pytest.raises(ValueError, match="key=value pairs"):
            gradzip.compressor_from_spec(spec)
        return
    built = gradzip.compressor_from_spec(spec)
    assert built == gradzip.compressor_from_spec(same_as)
    assert gradzip.compressor_from_spec(built.spec()) == built


def test_parse_spec_names_and_level_schedules_ignore_whitespace_alike() -> None:
    assert parse_spec(" topk : ratio = 0.5 ") == ("topk", {"ratio": 0.5})
    assert parse_level_schedule(" gentle : 0 - 5 , aggressive : 5 - 9 ") == [(0.0, 5.0)]
    with pytest.raises(ValueError, match="compressor name"):
        parse_spec("top k:ratio=0.5")  # whitespace inside a name is refused


def test_rule_text_ignores_whitespace_around_the_equals_sign() -> None:
    rule = gradzip.Rule.parse(" *.bias = topk : ratio=0.5 ")
    assert rule.pattern == "*.bias"
    assert rule.matches("fc.bias", torch.Size([4]))
    assert gradzip.compressor_from_spec(rule.spec) == gradzip.compressor_from_spec("topk:ratio=0.5")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1.2.3", "`level_schedule` parts must be KIND:START-END with KIND 'gentle' or "
         "'aggressive' and START, END in epochs (e.g. 'gentle:0-5'), got '1.2.3'"),
        ("dense:0-5", "`level_schedule` part kinds must be 'gentle' or 'aggressive', got "
         "'dense' in 'dense:0-5'"),
        ("gentle:0-1e3", "`level_schedule` epochs must be plain decimal numbers such as 5 or "
         "2.5 (no sign, exponent, nan or inf), got '1e3' in 'gentle:0-1e3'"),
        ("gentle:0-1.2.3", "`level_schedule` epochs must be plain decimal numbers such as 5 or "
         "2.5 (no sign, exponent, nan or inf), got '1.2.3' in 'gentle:0-1.2.3'"),
        ("gentle:5", "`level_schedule` ranges must be START-END in epochs (e.g. 'gentle:0-5'), "
         "got '5' in 'gentle:5'"),
        ("gentle:0-5,aggressive:5-nan", "`level_schedule` epochs must be plain decimal "
         "numbers such as 5 or 2.5 (no sign, exponent, nan or inf), got 'nan' in "
         "'aggressive:5-nan'"),
    ],
)
def test_level_schedule_errors_name_the_constraint_and_the_value(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_level_schedule(text)
    assert str(info.value) == message and "\n" not in str(info.value)


@pytest.mark.parametrize("bound", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, 1])
def test_schedule_refuses_epoch_bounds_that_are_not_finite(bound: float, where: int) -> None:
    pair = [0.0, 1.0]
    pair[where] = bound
    with pytest.raises(ValueError) as info:
        gradzip.Schedule("powersgd:rank=4", "powersgd:rank=1", gentle_epochs=[tuple(pair)],
                         steps_per_epoch=10)
    assert str(info.value) == f"`gentle_epochs` bounds must be finite numbers, got {bound!r}"
