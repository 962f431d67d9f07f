"""Run options declared once: RunConfig's fields, their checks, and the command line built
from them."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from gradzip.cli import build_parser
from gradzip.train.config import RunConfig, build_compressor, resolve_config, run_options


def _train_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["train"]


def _cli_values(*argv: str) -> dict:
    args = build_parser().parse_args(["train", *argv])
    return {f.name: getattr(args, f.name) for f, o in run_options() if o.cli}


def test_every_field_is_declared_with_an_option_and_documented() -> None:
    declared = run_options()
    assert [f.name for f, _ in declared] == [f.name for f in dataclasses.fields(RunConfig)]
    for field, option in declared:
        assert option.help.strip(), field.name
        if option.choices is not None:
            assert field.default in option.choices, field.name


def test_train_options_are_the_fields_on_the_command_line() -> None:
    parser = _train_parser()
    dests = {a.dest: a for a in parser._actions if a.dest not in ("help", "resume", "overwrite", "quiet")}
    on_cli = {f.name: o for f, o in run_options() if o.cli}
    assert set(dests) == set(on_cli)
    assert "timeout" not in dests  # declared off the command line
    for name, option in on_cli.items():
        assert dests[name].help == option.help, name
        if option.choices is not None:
            assert tuple(dests[name].choices) == option.choices, name
    text = parser.format_help()
    for flag in ("--no-scale-lr", "--rule", "--nesterov", "--no-error-feedback", "--dense-1d",
                 "--level-schedule", "--accordion-batch"):
        assert flag in text


def test_command_line_defaults_are_the_fields_defaults(tmp_path: Path) -> None:
    cfg = RunConfig.from_dict(_cli_values("--out", str(tmp_path)))
    assert cfg == RunConfig(out=str(tmp_path))


def test_every_flag_spelling_reaches_its_field(tmp_path: Path) -> None:
    cfg = RunConfig.from_dict(_cli_values(
        "--out", "x", "--workers", "3", "--no-scale-lr", "--rule", "*.bias=dense",
        "--rule", "fc*=topk:ratio=0.1", "--nesterov", "--no-error-feedback", "--dense-1d",
        "--tensorboard", "--milestones", "0.5,0.75", "--accordion-batch", "8,16",
        "--launcher", "sim", "--text-level", "char", "--eta", "0.25", "--lr", "0.05",
        "--accordion-rule", "first", "--warmup-steps", "3", "--gentle", "fp16"))
    assert (cfg.workers, cfg.scale_lr, cfg.nesterov, cfg.error_feedback) == (3, False, True, False)
    assert cfg.rules == ("*.bias=dense", "fc*=topk:ratio=0.1")
    assert (cfg.dense_1d, cfg.tensorboard, cfg.launcher, cfg.text_level) == (True, True, "sim",
                                                                             "char")
    assert cfg.milestones == (0.5, 0.75) and cfg.accordion_batch == (8, 16)
    assert (cfg.eta, cfg.lr, cfg.accordion_rule) == (0.25, 0.05, "first")
    assert (cfg.warmup_steps, cfg.gentle) == (3, "fp16")
    on = RunConfig.from_dict(_cli_values("--out", "x", "--error-feedback", "--no-nesterov"))
    assert (on.error_feedback, on.nesterov) == (True, False)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--out", "x", "--launcher", "nosuch"])


@pytest.mark.parametrize(("name", "option"), [(f.name, o) for f, o in run_options()
                                               if o.check is not None or o.choices])
def test_each_declared_check_names_its_field(tmp_path: Path, name: str, option: object) -> None:
    cfg = dataclasses.replace(RunConfig(task="digits", out=str(tmp_path / "run")),
                              **{name: "nonsense"})
    with pytest.raises((TypeError, ValueError), match=f"`{name}` must"):
        resolve_config(cfg)


def test_resolution_fills_defaults_and_builds_each_kind_of_compressor(tmp_path: Path) -> None:
    base = RunConfig(task="digits", out=str(tmp_path / "run"), compressor="powersgd:rank=1")
    cfg = resolve_config(base)
    assert cfg.epochs is not None and cfg.launcher == "sim"
    assert build_compressor(cfg, 10).spec() == "powersgd:rank=1"
    accordion = resolve_config(dataclasses.replace(base, accordion="powersgd:rank=2"))
    assert build_compressor(accordion, 10).spec_name == "accordion"
    schedule = resolve_config(dataclasses.replace(
        base, level_schedule="gentle:0-1,aggressive:1-3", gentle="powersgd:rank=2"))
    built = build_compressor(schedule, 10)
    assert built.spec_name == "schedule" and built.gentle_steps == ((0, 10),)
    with pytest.raises(ValueError, match="--level-schedule: `level_schedule` ranges"):
        resolve_config(dataclasses.replace(base, level_schedule="gentle:0-5,aggressive:4-9"))
