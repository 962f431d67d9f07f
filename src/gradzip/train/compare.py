"""Grids of runs from a TOML/YAML/JSON file or a built-in preset: run, tabulate, plot.

A grid file::

    name = "my-grid"                  # optional: title of the table and plot
    out = "gradzip-compare/my-grid"   # optional: default output root
    [base]                            # options shared by every run (``gradzip train`` names)
    task = "digits"
    workers = 4
    [grid]                            # optional: cross product of lists, applied to every run
    seed = [0, 1]
    [[runs]]                          # one table per run, merged over base (label optional)
    label = "top-k 1%"
    compressor = "topk:ratio=0.01"

Each run writes to ``OUT/<label>`` (grid values appended to the label). A run whose
``summary.json`` exists with the same result-determining configuration is skipped, and an
interrupted run continues from its checkpoint, so an interrupted grid resumes where it
stopped. A run directory holding another configuration's results stops the grid before any
run starts. ``OUT/results.csv`` and ``OUT/compare.png`` are rewritten (atomically) at the end;
with ``tensorboard``, ``OUT/tensorboard/<label>/`` holds each run's event files.
"""

from __future__ import annotations

import csv
import importlib.resources
import io
import itertools
import json
import logging
import os
import re
import sys
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TextIO

from gradzip.train.config import RunConfig, resolve_config
from gradzip.train.data import _read_utf8
from gradzip.train.events import EVENTS_DIR, require_tensorboard, write_events
from gradzip.train.idle import idle_options
from gradzip.train.metrics import format_bytes, read_metrics, read_summary
from gradzip.train.plots import plot_runs
from gradzip.train.resume import plan_out_dir
from gradzip.train.rundir import atomic_write_text
from gradzip.train.runner import run

__all__ = ["Grid", "GridRun", "format_table", "list_presets", "load_grid", "run_grid"]

log = logging.getLogger(__name__)

_TOP_KEYS = {"name", "description", "out", "base", "grid", "runs"}
#: Every run option's default.
DEFAULTS = {f.name: f.default for f in fields(RunConfig)}


@dataclass
class GridRun:
    """One run of a grid: its label and configuration (``out`` already set)."""

    label: str
    config: RunConfig


@dataclass
class Grid:
    """A parsed grid file: name, default output root, runs."""

    name: str
    out: str
    runs: list[GridRun] = field(default_factory=list)
    description: str = ""


def list_presets() -> dict[str, str]:
    """Built-in preset names -> their descriptions."""
    root = importlib.resources.files("gradzip.train").joinpath("presets")
    out = {}
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".toml"):
            text = entry.read_text(encoding="utf-8")
            out[entry.name[: -len(".toml")]] = str(_parse_toml(text, entry.name).get("description", ""))
    return out


def _parse_toml(text: str, where: str) -> dict[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            raise ValueError(
                f"reading {where} needs Python 3.11+ or the tomli package (pip install tomli)"
            ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"`config` must be valid TOML, got an error in {where}: {exc}") from None


def _read_source(source: str) -> tuple[dict[str, Any], str]:
    path = Path(source).expanduser()
    if path.is_file():
        text, suffix = _read_utf8("config", path), path.suffix.lower()
        if suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise ValueError(f"reading {source} needs PyYAML (pip install pyyaml)") from None
            try:
                return yaml.safe_load(text) or {}, path.stem
            except yaml.YAMLError as exc:
                raise ValueError(f"`config` must be valid YAML, got {exc}") from None
        if suffix == ".json":
            try:
                return json.loads(text), path.stem
            except json.JSONDecodeError as exc:
                raise ValueError(f"`config` must be valid JSON, got {exc}") from None
        return _parse_toml(text, str(path)), path.stem
    presets = list_presets()
    if source in presets:
        entry = importlib.resources.files("gradzip.train").joinpath(f"presets/{source}.toml")
        return _parse_toml(entry.read_text(encoding="utf-8"), f"preset {source}"), source
    raise ValueError(
        f"`config` must be a grid file (.toml, .yaml, .json) or a preset among "
        f"{', '.join(presets)}, got {source!r}"
    )


def _slug(text: str) -> str:
    """A directory name for a run label: ``"topk 1% <-> 10%"`` -> ``"topk-1pct-to-10pct"``."""
    text = text.replace("<->", " to ").replace("%", "pct")
    slug = re.sub(r"[^A-Za-z0-9._=-]+", "-", text).strip("-.")
    return re.sub(r"-{2,}", "-", slug) or "run"


def load_grid(source: str, overrides: dict[str, Any] | None = None,
              out: str | None = None) -> Grid:
    """Parse a grid file or preset into runs.

    Args:
        source: a path (``.toml``, ``.yaml``/``.yml``, ``.json``) or a preset name.
        overrides: option values applied to every run, over the file's (``--set``).
        out: output root, over the file's ``out``.

    Raises:
        ValueError, TypeError: unreadable file, unknown keys, invalid run options.
    """
    raw, stem = _read_source(source)
    if not isinstance(raw, dict):
        raise ValueError(f"`config` must be a table of keys, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _TOP_KEYS)
    if unknown:
        raise ValueError(f"`config` keys must be among {', '.join(sorted(_TOP_KEYS))}, got {unknown}")
    if not (raw.get("base") or raw.get("grid") or raw.get("runs")):
        # Without this, an empty file (or one holding only a name) would train the default
        # configuration: almost certainly not what was meant.
        raise ValueError(f"`config` must define runs ([base], [grid] or [[runs]] tables), got "
                         f"none in {source!r}")
    for key, kind in (("base", dict), ("grid", dict), ("runs", list)):
        if not isinstance(raw.get(key, kind()), kind):
            raise ValueError(f"`config` key {key!r} must be a "
                             f"{'table' if kind is dict else 'list of tables'}, got "
                             f"{raw[key]!r}")
    name = str(raw.get("name", stem))
    base = dict(raw.get("base", {}))
    grid = dict(raw.get("grid", {}))
    runs = list(raw.get("runs", [])) or [{}]
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ValueError(f"`grid.{key}` must be a non-empty list, got {values!r}")
    # Each run writes to ROOT/<its label>: an ``out`` per run would be dropped silently.
    for where, table in (("--set", overrides or {}), ("base", base), ("grid", grid),
                         *((f"runs[{i}]", e) for i, e in enumerate(runs) if isinstance(e, dict))):
        if "out" in table:
            raise ValueError(f"`out` must not be set per run in a comparison (each run writes to "
                             f"ROOT/<its label>; give ROOT with --out or the file's top-level "
                             f"`out`), got out={table['out']!r} in {where}")
    root = out or str(raw.get("out", f"gradzip-compare/{_slug(name)}"))
    result = Grid(name=name, out=root, description=str(raw.get("description", "")))
    seen: set[str] = set()
    for index, entry in enumerate(runs):
        if not isinstance(entry, dict):
            raise ValueError(f"`runs[{index}]` must be a table, got {entry!r}")
        entry = dict(entry)
        label = str(entry.pop("label", "") or entry.get("compressor", f"run{index}"))
        for point in itertools.product(*grid.values()):
            values = {**base, **dict(zip(grid, point, strict=True)), **entry, **(overrides or {})}
            suffix = ",".join(f"{k}={v}" for k, v in zip(grid, point, strict=True))
            full = f"{label} [{suffix}]" if suffix else label
            if full in seen:
                raise ValueError(f"`runs` labels must be unique, got {full!r} twice")
            seen.add(full)
            cfg = RunConfig.from_dict({**values, "out": str(Path(root) / _slug(full))})
            # An option shared by every run (base, grid, --set) applies to the runs where it
            # acts (interval_epochs to the Accordion runs beside plain ones); set in a run's
            # own table it must act there (see gradzip.train.idle).
            shared = {n: DEFAULTS[n] for n in idle_options(cfg) if n in values and n not in entry}
            result.runs.append(GridRun(full, replace(cfg, **shared)))
    return result


def _finished(cfg: RunConfig) -> dict[str, Any] | None:
    """The stored summary when ``cfg.out`` holds a finished run of the same configuration."""
    summary = read_summary(cfg.out)
    if summary is None:
        return None
    stored = RunConfig.from_stored(summary.get("config", {})).result_key()
    return summary if stored == cfg.result_key() else None


def run_grid(grid: Grid, *, force: bool = False, progress: bool = False,
             stream: TextIO | None = sys.stderr, tensorboard: bool = False,
             ) -> list[dict[str, Any]]:
    """Run (or reuse) every run of ``grid``; write ``results.csv`` and ``compare.png``.

    Every run and its directory are checked before the first run starts: a directory holding
    another configuration's results refuses the whole grid, touching nothing. A finished run
    of the same configuration is reused; an interrupted one continues from its checkpoint.

    Args:
        grid: from :func:`load_grid`.
        force: re-run finished runs too (from the beginning; each old run is replaced only
            once its new run has finished).
        progress: progress bars inside each run.
        stream: where one status line per run goes (None: silent).
        tensorboard: also write ``OUT/tensorboard/<run>/`` event files from each run's records
            (one folder per run, so TensorBoard overlays them).

    Returns:
        One row per run (see :func:`format_table`), in grid order, with ``csv``, ``plot`` and
        ``tensorboard`` paths under the keys of the first row's ``_files``.

    Raises:
        ValueError, TypeError: an invalid run, or a directory holding another configuration's
            results (the run and the first difference named).
    """
    resolved = [GridRun(r.label, resolve_config(r.config)) for r in grid.runs]  # fail early
    if tensorboard:
        require_tensorboard()
    for item in resolved:
        try:
            plan_out_dir(item.config, resume=not force, overwrite=force)
        except ValueError as exc:
            raise ValueError(f"run {item.label!r}: {exc}") from None
    rows = []
    for i, item in enumerate(resolved, 1):
        summary = None if force else _finished(item.config)
        status = "skipped (finished)"
        if summary is None:
            start = time.perf_counter()
            summary = run(replace(item.config), progress=progress, resume=not force,
                          overwrite=force)
            status = f"done in {time.perf_counter() - start:.1f} s"
        if stream is not None:
            print(f"[{i}/{len(resolved)}] {item.label}: {status}", file=stream, flush=True)
        rows.append(_row(item, summary))
    root = Path(grid.out)
    root.mkdir(parents=True, exist_ok=True)
    buffer = io.StringIO(newline="")
    fields = [k for k in rows[0] if not k.startswith("_")]
    writer = csv.DictWriter(buffer, fieldnames=fields, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    csv_path = atomic_write_text(root / "results.csv", buffer.getvalue())
    metric = rows[0]["metric"]
    tmp_plot = root / ".compare.tmp.png"
    plot = plot_runs([(r["label"], read_metrics(r["out"])) for r in rows], tmp_plot,
                     metric=metric, title=grid.name)
    if plot is not None:
        os.replace(tmp_plot, root / "compare.png")
        plot = root / "compare.png"
    events = None
    if tensorboard:
        events = root / EVENTS_DIR
        for r in rows:
            write_events(read_metrics(r["out"], kind=None), events / Path(r["out"]).name)
    for r in rows:
        r["_files"] = {"csv": str(csv_path), "plot": str(plot) if plot else None,
                       "tensorboard": str(events) if events else None}
    return rows


def _row(item: GridRun, summary: dict[str, Any]) -> dict[str, Any]:
    metric = summary["metric"]
    cfg = item.config
    return {
        "label": item.label,
        "task": cfg.task,
        "workers": cfg.workers,
        "compressor": cfg.compressor,
        "accordion": cfg.accordion or "",
        "seed": cfg.seed,
        "epochs": cfg.epochs,
        "metric": metric,
        "final": summary.get(f"final_{metric}"),
        "best": summary.get(f"best_{metric}"),
        "bytes_sent_per_worker": summary["bytes_sent_per_worker"],
        "dense_bytes_per_worker": summary["dense_bytes_per_worker"],
        "compression": summary.get("compression"),
        "steps": summary["steps"],
        "wall_seconds": summary["wall_seconds"],
        "out": cfg.out,
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width text table of grid rows (final metric, bytes, compression, wall time)."""
    if not rows:
        return "(no runs)"
    metric = rows[0]["metric"]

    def value(r: dict[str, Any]) -> str:
        v = r["final"]
        if v is None:
            return "-"
        return f"{100 * v:.1f}%" if metric == "accuracy" else f"{v:.2f}"

    header = ["run", metric, "sent/worker", "vs dense", "wall s"]
    body = [
        [r["label"], value(r), format_bytes(r["bytes_sent_per_worker"]),
         f"{r['compression']:.1f}x" if r["compression"] else "-", f"{r['wall_seconds']:.1f}"]
        for r in rows
    ]
    widths = [max(len(str(row[c])) for row in [header, *body]) for c in range(len(header))]
    lines = []
    for n, row in enumerate([header, *body]):
        cells = [row[0].ljust(widths[0])] + [str(c).rjust(w) for c, w in zip(row[1:], widths[1:],
                                                                            strict=True)]
        lines.append("  ".join(cells))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
