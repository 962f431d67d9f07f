"""Grids of runs: parsing, presets, skipping finished runs, the table and the CSV."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from gradzip.train.compare import format_table, list_presets, load_grid, run_grid
from gradzip.train.runner import resolve_config

TINY_BASE = 'task = "digits"\nworkers = 2\nepochs = 1\nlimit_train = 200\n'


def write(tmp_path: Path, text: str, name: str = "grid.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_grid_is_base_times_grid_times_runs(tmp_path: Path) -> None:
    src = write(tmp_path, 'name = "g"\n[base]\n' + TINY_BASE + '[grid]\nseed = [0, 1]\n'
                '[[runs]]\ncompressor = "none"\n[[runs]]\nlabel = "top 10%"\n'
                'compressor = "topk:ratio=0.1"\nepochs = 2\n')
    grid = load_grid(src, out=str(tmp_path / "out"))
    assert grid.name == "g"
    labels = [r.label for r in grid.runs]
    assert labels == ["none [seed=0]", "none [seed=1]", "top 10% [seed=0]", "top 10% [seed=1]"]
    assert [r.config.seed for r in grid.runs] == [0, 1, 0, 1]
    assert [r.config.epochs for r in grid.runs] == [1, 1, 2, 2]  # a run's keys win over base
    outs = {r.config.out for r in grid.runs}
    assert len(outs) == 4 and all(o.startswith(str(tmp_path / "out")) for o in outs)


def test_overrides_apply_to_every_run(tmp_path: Path) -> None:
    src = write(tmp_path, "[base]\n" + TINY_BASE + '[[runs]]\ncompressor = "none"\n'
                '[[runs]]\ncompressor = "sign"\n')
    grid = load_grid(src, overrides={"workers": 3})
    assert {r.config.workers for r in grid.runs} == {3}


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("[base]\n" + TINY_BASE + "[extra]\nx = 1\n", "config` keys"),
        ("[base]\nnosuch = 1\n", "run options"),
        ("[grid]\nseed = 3\n", "non-empty list"),
        ('[[runs]]\nlabel = "a"\n[[runs]]\nlabel = "a"\n', "unique"),
        ("[base\n", "valid TOML"),
    ],
)
def test_bad_grid_files_name_the_problem(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        load_grid(write(tmp_path, text))


def test_json_grid(tmp_path: Path) -> None:
    src = write(tmp_path, json.dumps({"base": {"task": "logreg"}, "runs": [{"compressor": "fp16"}]}),
                "g.json")
    assert load_grid(src).runs[0].config.compressor == "fp16"


def test_yaml_grid(tmp_path: Path) -> None:
    pytest.importorskip("yaml", reason="needs yaml (the `config` extra)")
    src = write(tmp_path, "base:\n  task: logreg\nruns:\n  - compressor: sign\n", "g.yaml")
    assert load_grid(src).runs[0].config.compressor == "sign"


def test_every_preset_parses_and_resolves(tmp_path: Path) -> None:
    presets = list_presets()
    assert {"demo", "digits-quick", "cifar10-accordion", "lm-accordion"} <= set(presets)
    for name in presets:
        grid = load_grid(name, overrides={"data": str(tmp_path)}
                         if name.startswith(("cifar10", "lm")) else None)
        assert grid.runs, name
        for item in grid.runs:
            resolve_config(item.config)  # every option valid (data: any existing path)


def test_run_grid_skips_finished_runs_and_refuses_changed_ones(tmp_path: Path, snapshot) -> None:
    src = write(tmp_path, "[base]\n" + TINY_BASE + '[[runs]]\ncompressor = "none"\n'
                '[[runs]]\ncompressor = "topk:ratio=0.1"\n')
    out = str(tmp_path / "out")
    log = io.StringIO()
    rows = run_grid(load_grid(src, out=out), stream=log)
    assert log.getvalue().count("done in") == 2
    with open(Path(out) / "results.csv", newline="") as fh:
        table = list(csv.DictReader(fh))
    assert [t["compressor"] for t in table] == ["none", "topk:ratio=0.1"]
    assert float(table[1]["compression"]) > 1 and table[0]["metric"] == "accuracy"
    stamps = [(Path(r["out"]) / "summary.json").stat().st_mtime_ns for r in rows]

    log = io.StringIO()
    again = run_grid(load_grid(src, out=out), stream=log)
    assert log.getvalue().count("skipped") == 2
    assert [(Path(r["out"]) / "summary.json").stat().st_mtime_ns for r in again] == stamps
    assert [r["final"] for r in again] == [r["final"] for r in rows]

    log = io.StringIO()
    run_grid(load_grid(src, out=out), stream=log, force=True)
    assert log.getvalue().count("done in") == 2

    # Another configuration in the same directories: refused before any run, nothing changed.
    before = snapshot(Path(out))
    for force in (False, True):
        with pytest.raises(ValueError, match=r"run 'none'.*another configuration \(lr 0.025 "
                                             r"there, 0.01 here\)"):
            run_grid(load_grid(src, out=out, overrides={"lr": 0.01}), stream=None, force=force)
    assert snapshot(Path(out)) == before


def test_an_unfinished_run_is_rerun(tmp_path: Path) -> None:
    src = write(tmp_path, "[base]\n" + TINY_BASE + '[[runs]]\ncompressor = "none"\n')
    out = tmp_path / "out"
    rows = run_grid(load_grid(src, out=str(out)), stream=None)
    (Path(rows[0]["out"]) / "summary.json").unlink()
    log = io.StringIO()
    run_grid(load_grid(src, out=str(out)), stream=log)
    assert "done in" in log.getvalue()


def test_format_table() -> None:
    rows = [
        {"label": "none", "metric": "accuracy", "final": 0.9, "bytes_sent_per_worker": 2048,
         "compression": 1.0, "wall_seconds": 1.25},
        {"label": "topk 1%", "metric": "accuracy", "final": 0.85,
         "bytes_sent_per_worker": 100, "compression": 20.48, "wall_seconds": 0.5},
    ]
    lines = format_table(rows).splitlines()
    assert lines[0].split() == ["run", "accuracy", "sent/worker", "vs", "dense", "wall", "s"]
    assert lines[2].split() == ["none", "90.0%", "2.0", "KiB", "1.0x", "1.2"]
    assert lines[3].split()[-2:] == ["20.5x", "0.5"]
    assert format_table([]) == "(no runs)"
