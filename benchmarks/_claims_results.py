"""The claims grid's finished runs (``claims.py``): which planned runs a run folder already
holds, the archive of their files (``--pack``, ``--resume-from``) and the ``claims.json`` rows
and table (``--collect``). ``claims.py`` imports it from beside itself, after putting the
checkout's ``src`` on ``sys.path``."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path
from typing import Any

from gradzip.bench.table import format_table
from gradzip.train.metrics import read_summary
from gradzip.train.runner import RunConfig

from ._claims_plan import Planned

#: The files of a run that the archive keeps.
PACKED = ("summary.json", "metrics.jsonl", "accordion_decisions.json")
#: Options that may differ between a planned run and a finished one it is taken for: where the
#: data and outputs lie and how the run was executed (results packed on another machine).
PLACE = ("out", "data", "cache_dir", "device", "threads", "timeout", "launcher")


def finished(cfg: RunConfig) -> dict[str, Any] | None:
    """The summary in ``cfg.out`` when it is a finished run of ``cfg``: every option the plan
    sets (all but :data:`PLACE`) equal in the stored configuration. Options the plan leaves to
    the task's defaults are not compared, so no data need be present to check."""
    summary = read_summary(cfg.out)
    if summary is None:
        return None
    config = RunConfig.from_stored(summary.get("config", {})).to_dict()
    for key, value in cfg.to_dict().items():
        if key not in PLACE and value is not None and config.get(key) != value:
            return None
    return summary


def unpack(archive: Path, root: Path) -> int:
    """Restore the finished runs of an archive written by :func:`pack` under ``root``
    (existing files are kept); returns the number of summaries restored."""
    count = 0
    with tarfile.open(archive, "r:*") as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if not member.isfile() or any(p.endswith(".stopped") for p in parts):
                continue
            if (root / member.name).exists():
                continue
            tar.extract(member, root, filter="data")
            count += member.name.endswith("summary.json")
    return count


def pack(root: Path, archive: Path) -> int:
    """Archive every finished run's files under ``root`` (paths relative to it), the partial
    ones of runs the deadline ended (``*.stopped`` folders), and every run's log
    (``<run>.log`` beside its folder), into ``archive``, atomically; returns the number of
    finished runs packed."""
    runs = sorted(p.parent for p in root.rglob("summary.json"))
    stopped = sorted(root.rglob("seed*.stopped"))
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_name(archive.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for folder in runs + stopped:
            for name in PACKED:
                if (folder / name).is_file():
                    tar.add(folder / name, arcname=str((folder / name).relative_to(root)))
        for log in sorted(root.rglob("seed*.log")):
            tar.add(log, arcname=str(log.relative_to(root)))
    os.replace(tmp, archive)
    return len(runs)


def collect(runs: list[Planned]) -> list[dict[str, Any]]:
    """One row per finished run, from its own ``summary.json``."""
    rows = []
    for r in runs:
        summary = finished(r.config)
        if summary is None:
            continue
        metric = summary["metric"]
        final = summary.get(f"final_{metric}")
        if final is not None and metric == "accuracy":
            final = round(100.0 * final, 6)  # percent, without binary noise (70.51, not 70.50999999999999)
        rows.append({"setting": r.setting, "family": r.family, "role": r.role, "spec": r.spec,
                     "seed": r.seed, "metric": metric, "final": final,
                     "wire_bytes_per_worker": summary["bytes_sent_per_worker"]})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Mean final metric and bytes over seeds, per setting, family and spec (a Markdown table in
    ``gradzip.bench``'s layout)."""
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["setting"], row["family"], row["role"], row["spec"]), []).append(row)
    cells = []
    for (setting, family, role, spec), items in groups.items():
        finals = [i["final"] for i in items if i["final"] is not None]
        mean = sum(finals) / len(finals) if finals else float("nan")
        spread = max(finals) - min(finals) if finals else float("nan")
        mb = sum(i["wire_bytes_per_worker"] for i in items) / len(items) / 1e6
        cells.append({"setting": setting, "family": family, "role": role, "seeds": len(items),
                      "final": f"{mean:.2f}", "spread": f"{spread:.2f}", "mb": f"{mb:.1f}",
                      "spec": spec})
    return format_table(cells, [("setting", "setting"), ("family", "family"), ("role", "role"),
                                ("seeds", "seeds"), ("final", "final"), ("spread", "spread"),
                                ("mb", "MB/worker"), ("spec", "spec")])
