"""Configuration that would do nothing is refused with one line naming it: a rule that decides
no parameter (its glob matches none, or every match is decided before it), a level-schedule
range shorter than one step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import gradzip
from gradzip.cli import main
from gradzip.control import Schedule

SHAPES = {
    "enc.weight": torch.Size((24, 16)),
    "enc.bias": torch.Size((24,)),
    "head.weight": torch.Size((4, 16)),
    "head.bias": torch.Size((4,)),
}


def engine(**options: Any) -> gradzip.Engine:
    return gradzip.Engine(SHAPES, "topk:ratio=0.1", collective=gradzip.SimulatedGroup(2), **options)


@pytest.mark.parametrize(("options", "fragments"), [
    ({"rules": ["encoder.*=dense"]},
     ["rule 'encoder.*=dense' must match a parameter", "enc.weight, enc.bias"]),
    ({"rules": [("*", "sign", 0)]}, ["rule '*=sign [ndim<=0]' must match a parameter"]),
    ({"rules": ["*.weight=sign", "enc.weight=fp16"]},
     ["rule 'enc.weight=fp16' must decide a parameter", "'enc.weight' by rule '*.weight=sign'"]),
    ({"rules": ["*.bias=sign"], "dense_1d": True},
     ["rule '*.bias=sign' must decide a parameter", "'enc.bias' by `dense_1d`"]),
    ({"rules": ["head.*=powersgd:rank=1"], "min_numel": 100},
     ["rule 'head.*=powersgd:rank=1'", "'head.weight' by `min_numel=100`"]),
    ({"rules": ["enc.*=dense", "*.bias=dense", "enc.bias=sign"]},
     ["rule 'enc.bias=sign'", "by rule 'enc.*=dense'"]),
])
def test_a_rule_that_decides_no_parameter_is_refused(options: dict[str, Any],
                                                     fragments: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        engine(**options)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_rules_that_decide_something_are_accepted() -> None:
    # A rule partly shadowed still decides the parameters left to it.
    made = engine(rules=["enc.weight=sign", "*.weight=fp16", "*=dense"], min_numel=20)
    assert made.stats["steps"] == 0
    engine(rules=["*.bias=dense"])
    engine(rules=[("*", "sign", 1)], dense_1d=False)


def test_a_gentle_range_shorter_than_a_step_is_refused() -> None:
    with pytest.raises(ValueError, match=r"`gentle_epochs` range 2-2.05 must cover at least one "
                                         r"step, but at 5 steps per epoch it rounds to steps 10-10"):
        Schedule.from_text("gentle:0-1,aggressive:1-2,gentle:2-2.05", "topk:ratio=0.1",
                           steps_per_epoch=5)
    # A range of a fraction of an epoch that still covers a step is kept.
    kept = Schedule.from_text("gentle:0-0.2,aggressive:0.2-1", "topk:ratio=0.1", steps_per_epoch=5)
    assert kept.gentle_steps == ((0, 1),)


def test_an_aggressive_part_shorter_than_a_step_is_refused() -> None:
    with pytest.raises(ValueError, match=r"part aggressive:1-1.05 must cover at least one step, "
                                         r"but at 5 steps per epoch it rounds to steps 5-5"):
        Schedule.from_text("gentle:0-1,aggressive:1-1.05,gentle:1.05-2", "topk:ratio=0.1",
                           steps_per_epoch=5)


@pytest.mark.parametrize(("extra", "message"), [
    (["--rule", "nope.*=dense"], "--rule: rule 'nope.*=dense' must match a parameter"),
    # With processes the engine is built only at the first DDP bucket: refused before that.
    (["--rule", "nope.*=dense", "--launcher", "procs", "--threads", "1"],
     "--rule: rule 'nope.*=dense' must match a parameter"),
    (["--rule", "*.weight=sign", "--rule", "classifier.1.weight=fp16"],
     "rule 'classifier.1.weight=fp16' must decide a parameter"),
    (["--level-schedule", "gentle:0-0.01,aggressive:0.01-1"],
     "--level-schedule: `gentle_epochs` range 0-0.01 must cover at least one step"),
    (["--optimizer", "adamw", "--momentum", "0.9"],
     "`momentum` must be unset with `optimizer` 'adamw' (SGD's momentum; AdamW's betas are "
     "0.9, 0.95), got momentum=0.9"),
    (["--optimizer", "adamw", "--nesterov"],
     "`nesterov` must be unset with `optimizer` 'adamw' (SGD's Nesterov momentum), got "
     "nesterov=True"),
    (["--eta", "0.3"], "`eta` needs `accordion` or `accordion_batch` (it tunes their "
     "decisions), got eta=0.3"),
    (["--interval-epochs", "2"], "`interval_epochs` needs `accordion` or `accordion_batch` "
     "(it times their decisions), got interval_epochs=2.0"),
])
def test_the_cli_refuses_them_before_writing(extra: list[str], message: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    code = main(["train", "--task", "digits", "--epochs", "1", "--workers", "2", "--limit-train",
                 "200", "--compressor", "topk:ratio=0.1", "--out", str(out), "--quiet", *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_the_ddp_hook_state_refuses_them_when_made() -> None:
    """The hook's engine is built at the first bucket: the rule is refused before, when the
    state is made (no process group needed)."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    with pytest.raises(ValueError, match=r"rule 'head\.\*=dense' must match a parameter, but its "
                                         r"glob matches none of this model's \(0\.weight, 0\.bias\)"):
        gradzip.ddp.GradzipHookState(model.named_parameters(), "topk:ratio=0.1",
                                     rules=["head.*=dense"])
    gradzip.ddp.GradzipHookState(model.named_parameters(), "topk:ratio=0.1", rules=["*.bias=dense"])


def test_options_refused_alone_are_accepted_where_they_act_and_resolve_twice() -> None:
    """``eta``/``interval_epochs`` with either controller, SGD options with SGD; a resolved
    configuration resolves again unchanged (a comparison resolves each run twice), and the
    options that act on nothing are no part of the result key."""
    from gradzip.train.config import RunConfig, resolve_config

    base = {"task": "digits", "compressor": "topk:ratio=0.1", "out": "unused"}
    for extra in ({"accordion": "topk:ratio=0.5", "eta": 0.3, "interval_epochs": 2.0},
                  {"accordion_batch": (128, 256), "eta": 0.3, "interval_epochs": 2.0},
                  {"momentum": 0.5, "nesterov": True}, {"optimizer": "adamw"}, {}):
        once = resolve_config(RunConfig.from_dict({**base, **extra}))
        assert resolve_config(once) == once, extra
    adamw = resolve_config(RunConfig.from_dict({**base, "optimizer": "adamw"}))
    assert adamw.momentum is None and adamw.nesterov is None  # nothing recorded that did not act
    plain = resolve_config(RunConfig.from_dict(base))
    assert plain.interval_epochs is None and "interval_epochs" not in plain.result_key()
    assert "eta" not in plain.result_key()
    # A summary written before: the task's momentum and interval were recorded for every run.
    stored = {**plain.to_dict(), "interval_epochs": 10.0}
    assert plain.first_difference(stored) is None
    stored = {**adamw.to_dict(), "momentum": 0.9, "nesterov": False}
    assert adamw.first_difference(stored) is None
    assert RunConfig.from_stored(stored).result_key() == adamw.result_key()


def test_compare_refuses_an_output_set_per_run(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A comparison writes each run to ROOT/<its label>: an ``out`` given per run (``--set``,
    ``base``, a run's table) used to be dropped silently."""
    root = tmp_path / "cmp"
    for grid, extra in (({"base": {"task": "digits"}, "runs": [{"compressor": "none"}]},
                         ["--set", f"out={tmp_path / 'x'}"]),
                        ({"base": {"task": "digits", "out": "elsewhere"}}, []),
                        ({"runs": [{"compressor": "none", "out": "elsewhere"}]}, [])):
        path = tmp_path / "grid.json"
        path.write_text(json.dumps(grid))
        code = main(["compare", str(path), "--out", str(root), "--quiet", *extra])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "`out` must not be set per run in a comparison" in err, err
        assert not root.exists() and not (tmp_path / "x").exists()


def test_a_comparison_applies_shared_options_where_they_act(tmp_path: Path) -> None:
    """``interval_epochs`` in ``base`` times the Accordion run and leaves the plain one alone;
    in a plain run's own table it is refused."""
    from gradzip.train.compare import load_grid
    from gradzip.train.config import resolve_config

    path = tmp_path / "grid.json"
    path.write_text(json.dumps({
        "base": {"task": "digits", "interval_epochs": 2, "eta": 0.25},
        "runs": [{"compressor": "none"},
                 {"compressor": "topk:ratio=0.1", "accordion": "topk:ratio=0.5"}]}))
    plain, accordion = [resolve_config(r.config) for r in load_grid(str(path)).runs]
    assert (plain.interval_epochs, plain.eta) == (None, 0.5)
    assert (accordion.interval_epochs, accordion.eta) == (2.0, 0.25)
    path.write_text(json.dumps({"base": {"task": "digits"},
                                "runs": [{"compressor": "none", "interval_epochs": 2}]}))
    with pytest.raises(ValueError, match="`interval_epochs` needs `accordion` or `accordion_batch`"):
        resolve_config(load_grid(str(path)).runs[0].config)
