"""The outer loop's engine options (a record and keywords read alike) and level schedules
counted in inner steps."""

from __future__ import annotations

import pytest
import torch

import gradzip
from gradzip.control import Schedule
from gradzip.outer.fragments import FragmentPlan
from gradzip.outer.setup import schedule_in_syncs
from gradzip.train.config import RunConfig, resolve_config
from outer_helpers import inner_step, make_inner, make_model


def _outer(compressor="topk:ratio=0.2", **kwargs):
    kwargs.setdefault("inner_steps", 2)
    return gradzip.Outer([make_model() for _ in range(2)], compressor,
                         collective=gradzip.SimulatedGroup(2), **kwargs)


# -- options: the record and the keywords ------------------------------------------------------
@pytest.mark.parametrize("kwargs", [
    dict(options=gradzip.EngineOptions(error_feedback=False)),
    dict(error_feedback=False),
    dict(options=gradzip.EngineOptions(error_feedback=True), error_feedback=False),
])
def test_error_feedback_off_under_ef_momentum_is_refused_however_given(kwargs) -> None:
    with pytest.raises(ValueError) as info:
        _outer(outer_optimizer="ef-momentum", **kwargs)
    text = str(info.value)
    assert "\n" not in text
    assert "`error_feedback`" in text and "ef-momentum" in text and "`outer_optimizer`" in text


def test_ef_momentum_runs_with_error_feedback_and_other_record_options_are_kept() -> None:
    outer = _outer(outer_optimizer="ef-momentum",
                   options=gradzip.EngineOptions(nonfinite="zero", dense_1d=True))
    assert outer.engine.error_feedback is True
    assert outer.engine.nonfinite == "zero" and outer.engine.dense_1d is True
    # Keywords replace the record's fields, as the engine's own constructor does.
    outer = _outer(options=gradzip.EngineOptions(nonfinite="zero"), nonfinite="raise")
    assert outer.engine.nonfinite == "raise"


def test_gradient_only_options_in_the_record_are_refused() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="`optimizer` applies to gradients, not pseudo-gradients"):
        _outer(options=gradzip.EngineOptions(optimizer=opt))


def test_decide_on_reaches_the_engine_and_is_validated() -> None:
    assert _outer(decide_on="host").engine.decide_on == "host"
    with pytest.raises(ValueError, match="`decide_on` must be one of"):
        _outer(decide_on="gpu")


def test_the_command_line_refuses_no_error_feedback_under_ef_momentum() -> None:
    cfg = RunConfig(task="digits", outer_steps=4, outer_optimizer="ef-momentum", error_feedback=False)
    with pytest.raises(ValueError, match="`error_feedback` must be on for the ef-momentum") as info:
        resolve_config(cfg)
    assert "\n" not in str(info.value)
    resolve_config(RunConfig(task="digits", outer_steps=4, outer_optimizer="ef-momentum"))


# -- level schedules count inner steps -----------------------------------------------------------
def test_a_warmup_counts_inner_steps_not_synchronisations() -> None:
    # Warm-up of 20 inner steps with H = 5: the synchronisations sent after steps 5, 10, 15
    # and 20 are gentle (4 of them), not the first 20 synchronisations.
    outer = _outer(Schedule.warmup("topk:ratio=0.2", steps=20), inner_steps=5)
    assert outer.engine.compressor.gentle_steps == ((0, 4),)
    models = outer.models
    opts = [make_inner(m) for m in models]
    dense_syncs = []
    for step in range(40):
        for rank, (m, o) in enumerate(zip(models, opts, strict=True)):
            inner_step(m, o, step, rank)
        before = outer.stats["payload_bytes"][0]
        if outer.step() and step + 1 >= 5:
            sent = outer.stats["payload_bytes"][0] - before
            dense_syncs.append(sent >= 4 * sum(p.numel() for p in models[0].parameters()))
    assert dense_syncs == [True] * 4 + [False] * 4


@pytest.mark.parametrize(("ranges", "period", "want"), [
    ([(0, 20)], 5, ((0, 4),)),      # syncs after steps 5, 10, 15, 20 (0-based 4 .. 19)
    ([(0, 21)], 5, ((0, 4),)),      # step 21 (0-based 20) sends nothing
    ([(0, 24)], 5, ((0, 4),)),
    ([(0, 25)], 5, ((0, 5),)),      # 0-based 24: the sync after step 25
    ([(4, 5), (9, 15)], 5, ((0, 1), (1, 3))),
    ([(0, 3)], 1, ((0, 3),)),       # H = 1: syncs are steps
])
def test_schedule_ranges_move_to_the_synchronisations_sent_inside_them(ranges, period, want) -> None:
    schedule = Schedule("none", "topk:ratio=0.1", gentle_steps=ranges)
    assert schedule_in_syncs(schedule, FragmentPlan(period)).gentle_steps == want


def test_a_gentle_range_without_a_synchronisation_is_refused() -> None:
    with pytest.raises(ValueError, match="gentle range 0-4 .* holds none"):
        _outer(Schedule.warmup("topk:ratio=0.2", steps=4), inner_steps=5)


def test_fragments_count_every_send() -> None:
    # H = 4, P = 2: a send every 2 inner steps.
    schedule = Schedule.warmup("topk:ratio=0.2", steps=8)
    assert schedule_in_syncs(schedule, FragmentPlan(4, fragments=2)).gentle_steps == ((0, 4),)
    assert schedule_in_syncs("topk:ratio=0.2", FragmentPlan(4)).spec() == "topk:ratio=0.2"
