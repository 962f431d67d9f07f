"""What gpu_step.py runs and how it reports it: the configurations, the setups planned for
the GPUs present, the result rows and the Markdown table. Plain Python at import (no torch, no CUDA):
the table alone borrows ``gradzip.bench``'s layout when it is made."""

from __future__ import annotations

import statistics
from typing import Any

ACCORDION = "accordion(steady=powersgd:rank=1,critical=powersgd:rank=4,eta=0.5,interval=10)"
# name -> what it is. ``local`` has no DDP at all: the floor no communication scheme can beat.
CONFIGS = {
    "local": "the model without DDP (no communication)",
    "ddp": "native DDP, no hook (fp32 all-reduce overlapped with the backward pass)",
    "torch-fp16": "PyTorch's fp16_compress_hook",
    "torch-powersgd:rank=4": "PyTorch's powerSGD_hook, rank 4, start_powerSGD_iter=2, one bucket",
    "gradzip:none": "gradzip hook, no compression",
    "gradzip:fp16": "gradzip hook, fp16",
    "gradzip:powersgd:rank=4": "gradzip hook, PowerSGD rank 4",
    "gradzip:topk:ratio=0.01": "gradzip hook, Top-k 1%",
    f"gradzip:{ACCORDION}": "gradzip hook, Accordion PowerSGD rank 1 <-> 4 (interval 10 steps)",
}


def plan(device: str, gpus: int) -> list[dict[str, Any]]:
    """The setups to run for ``device`` ("cuda" or "cpu") with ``gpus`` GPUs present."""
    if device == "cpu":
        return [{"name": "cpu-gloo-2", "backend": "gloo", "world": 2, "device": "cpu",
                 "placement": "two CPU processes"}]
    setups = []
    if gpus >= 2:
        setups.append({"name": "nccl-2gpu", "backend": "nccl", "world": 2, "device": "cuda",
                       "placement": "two ranks, one GPU each, NCCL"})
    else:
        setups.append({"name": "gloo-1gpu", "backend": "gloo", "world": 2, "device": "cuda",
                       "placement": "two ranks sharing GPU 0 over gloo (CUDA tensors staged "
                                    "through host memory; NCCL refuses two ranks on one GPU)"})
    setups.append({"name": "nccl-1rank", "backend": "nccl", "world": 1, "device": "cuda",
                   "placement": "one rank on GPU 0, NCCL: nothing travels; compression "
                                "arithmetic only"})
    return setups


# -- rows and the report ------------------------------------------------------------------
def make_row(setup: dict[str, Any], config: str, **fields: Any) -> dict[str, Any]:
    """The result record of ``config`` in ``setup``: no time until ``fields`` give one."""
    return {"setup": setup["name"], "backend": setup["backend"], "world": setup["world"],
            "device": setup["device"], "config": config, "median_s": None, "min_s": None,
            "steps": 0, "syncs": None, "error": None, **fields}


def finish_row(setup: dict[str, Any], config: str,
               reports: dict[int, tuple[str, Any]]) -> dict[str, Any]:
    """The row of ``config`` from every rank's report: ``("done", (step times, syncs))`` or
    ``("error", traceback)``."""
    errors = [f"rank {r}: {v}" for r, (kind, v) in sorted(reports.items()) if kind == "error"]
    if errors:
        return make_row(setup, config, error="\n".join(errors))
    # A step ends for everyone when the slowest rank finishes it.
    per_step = [max(reports[r][1][0][i] for r in reports) for i in range(len(reports[0][1][0]))]
    return make_row(setup, config, median_s=statistics.median(per_step), min_s=min(per_step),
                    steps=len(per_step), syncs=reports[0][1][1])


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: one line per row, ratios to native DDP (and to no DDP) in the same setup."""
    base = {r["setup"]: r["median_s"] for r in rows if r["config"] == "ddp" and r["median_s"]}
    floor = {r["setup"]: r["median_s"] for r in rows if r["config"] == "local" and r["median_s"]}
    from gradzip.bench.table import format_table  # imports torch: only when a table is made

    head = ["setup", "backend, ranks", "configuration", "ms/step (median)", "x native DDP",
            "x no DDP", "host syncs/step", "note"]
    cells = []
    for r in rows:
        med = r["median_s"]
        ratio = f"{med / base[r['setup']]:.2f}" if med and r["setup"] in base else ""
        over = f"{med / floor[r['setup']]:.2f}" if med and r["setup"] in floor else ""
        note = "" if r["error"] is None else r["error"].strip().splitlines()[-1][:100].replace("|", "/")
        ms = f"{med * 1e3:.1f}" if med else "-"
        syncs = f"{r['syncs']['per_step']:g}" if r.get("syncs") else ""
        cells.append(dict(enumerate([r["setup"], f"{r['backend']}, {r['world']}",
                                     f"`{r['config']}`", ms, ratio, over, syncs, note])))
    return format_table(cells, list(enumerate(head)))


def sync_sites(rows: list[dict[str, Any]], top: int = 6) -> str:
    """Where each row's host syncs come from (per step, most frequent first)."""
    lines = []
    for r in rows:
        if r.get("syncs") and r["syncs"]["sites"]:
            sites = list(r["syncs"]["sites"].items())[:top]
            lines.append(f"{r['setup']} {r['config']}: " + ", ".join(f"{k} x{v:g}" for k, v in sites))
    return "\n".join(lines)
