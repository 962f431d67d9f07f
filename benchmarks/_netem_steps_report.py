"""What ``netem_steps.py`` reports: the table rows from the workers' record (the slowest rank
per round, ratios as medians of per-round ratios), the measured communication : compute of a
dense step, the verdicts of the step-time targets and the text printed and written beside the
JSON. ``netem_steps.py`` imports it from beside itself."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from gradzip.bench.table import format_table

from . import netem_steps_worker as worker

#: The issue's targets: (label, configuration, reference, bound, kind). ``at_most``: the
#: median per-round ratio config/reference must be <= bound; ``speedup``: reference/config
#: must be >= bound.
TARGETS = (
    ("gradzip none within 5% of native DDP", "gradzip-none", "ddp", 1.05, "at_most"),
    ("gradzip fp16 within 5% of fp16_compress_hook", "gradzip-fp16", "torch-fp16", 1.05,
     "at_most"),
    ("gradzip PowerSGD rank 4 at least 1.5x faster than native DDP", "gradzip-powersgd-r4",
     "ddp", 1.5, "speedup"),
    ("gradzip PowerSGD rank 4 within 1.25x of the no-DDP floor", "gradzip-powersgd-r4",
     "floor", 1.25, "at_most"),
)


def slowest_rank(ranks: Sequence[dict[str, Any]], key: str = "seconds") -> dict[str, list[float]]:
    """Per configuration, per round, the slowest rank's value (a step ends for everyone at
    its last collective)."""
    configs = ranks[0][key]
    return {c: [max(r[key][c][i] for r in ranks) for i in range(len(ranks[0][key][c]))]
            for c in configs}


def rank_mean(ranks: Sequence[dict[str, Any]], key: str) -> dict[str, list[float]]:
    """Per configuration, per round, the mean over ranks (CPU time)."""
    configs = ranks[0][key]
    return {c: [statistics.mean(r[key][c][i] for r in ranks)
                for i in range(len(ranks[0][key][c]))] for c in configs}


def paired_ratio(values: Sequence[float], base: Sequence[float]) -> float:
    """Median over rounds of ``values[r] / base[r]`` (both timed in round ``r``)."""
    if len(values) != len(base) or not values:
        raise ValueError(f"`values` and `base` must be equally long and non-empty, got "
                         f"{len(values)} and {len(base)}")
    return statistics.median(v / b for v, b in zip(values, base, strict=True))


def dense_serial_config(configs: Sequence[str], sync_keyword: dict[str, Any] | None) -> str | None:
    """The configuration whose step is compute + dense communication in series: gradzip
    ``none`` in synchronous mode (``gradzip-none`` itself while ``register`` has no mode
    keyword, i.e. before the asynchronous hook); ``None`` when it was not timed."""
    if "gradzip-none" + worker.SYNC_SUFFIX in configs:
        return "gradzip-none" + worker.SYNC_SUFFIX
    if sync_keyword is None and "gradzip-none" in configs:
        return "gradzip-none"
    return None


def comm_compute_ratio(times: dict[str, list[float]], dense: str | None) -> dict[str, Any]:
    """Measured communication : compute of a dense step: per round ``(dense - floor) / floor``,
    median over rounds; ``None`` entries when ``dense`` or ``floor`` was not timed."""
    if dense is None or dense not in times or "floor" not in times:
        return {"dense_config": dense, "comm_seconds": None, "ratio": None}
    comm = [d - f for d, f in zip(times[dense], times["floor"], strict=True)]
    return {"dense_config": dense, "comm_seconds": statistics.median(comm),
            "ratio": paired_ratio(comm, times["floor"])}


def summarise(record: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, list[float]]]:
    """Rows of the table (one per configuration) and the per-round slowest-rank seconds."""
    ranks = record["ranks"]
    times, cpu = slowest_rank(ranks), rank_mean(ranks, "cpu_seconds")
    rows = []
    for c in record["configs"]:
        hook = ranks[0]["hook_bytes_per_step"].get(c, {})
        rows.append({
            "config": c,
            "buckets": ranks[0]["buckets"].get(c),
            "ms_per_step": 1e3 * statistics.median(times[c]),
            "vs_ddp": paired_ratio(times[c], times["ddp"]) if "ddp" in times else None,
            "vs_floor": paired_ratio(times[c], times["floor"]) if "floor" in times else None,
            "cpu_ms_per_step": 1e3 * statistics.median(cpu[c]),
            "kernel_tx_bytes_per_step": statistics.mean(
                r["kernel_tx_bytes_per_step"][c] for r in ranks),
            "hook_wire_bytes_per_step": hook.get("wire_bytes"),
        })
    return rows, times


def verdicts(times: dict[str, list[float]]) -> list[dict[str, Any]]:
    """One entry per target and gradzip hook mode timed: the median per-round ratio and
    whether it meets the target (``met`` is ``None`` when a configuration is missing)."""
    out = []
    for label, config, ref, bound, kind in TARGETS:
        for suffix in ("", worker.SYNC_SUFFIX):
            name = config + suffix
            if suffix and name not in times:
                continue
            entry: dict[str, Any] = {"target": label, "config": name, "reference": ref,
                                     "kind": kind, "bound": bound, "ratio": None, "met": None}
            if name in times and ref in times:
                if kind == "speedup":
                    entry["ratio"] = paired_ratio(times[ref], times[name])
                    entry["met"] = entry["ratio"] >= bound
                else:
                    entry["ratio"] = paired_ratio(times[name], times[ref])
                    entry["met"] = entry["ratio"] <= bound
            out.append(entry)
    return out


def verdict_line(v: dict[str, Any]) -> str:
    """e.g. ``"met: gradzip none within 5% of native DDP (gradzip-none / ddp = 1.031x, bound
    1.05)"``; a speedup reads reference / configuration."""
    if v["met"] is None:
        return f"not measured: {v['target']} ({v['config']} or {v['reference']} not timed)"
    what = (f"{v['reference']} / {v['config']} = {v['ratio']:.3f}x" if v["kind"] == "speedup"
            else f"{v['config']} / {v['reference']} = {v['ratio']:.3f}x")
    return f"{'met' if v['met'] else 'MISSED'}: {v['target']} ({what}, bound {v['bound']:g})"


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """ms/step, ratios and bytes per configuration."""
    head = ["configuration", "buckets", "ms / step", "vs native DDP", "vs no-DDP floor",
            "CPU ms / step", "kB sent / worker / step"]

    def ratio(x: float | None) -> str:
        return f"{x:.3f}" if x is not None else "-"

    cells = [dict(enumerate([
        r["config"], str(r["buckets"] if r["buckets"] is not None else "-"),
        f"{r['ms_per_step']:.1f}", ratio(r["vs_ddp"]), ratio(r["vs_floor"]),
        f"{r['cpu_ms_per_step']:.1f}", f"{r['kernel_tx_bytes_per_step'] / 1e3:,.0f}"]))
        for r in rows]
    return format_table(cells, list(enumerate(head)))


def builtin_powersgd_note(rows: Sequence[dict[str, Any]]) -> list[str]:
    """A line saying how many buckets the built-in ``powerSGD_hook`` ran with, when timed."""
    got = {r["config"]: r["buckets"] for r in rows}
    if "torch-powersgd-r4" not in got:
        return []
    return [f"torch-powersgd-r4 ran on {got['torch-powersgd-r4']} bucket(s) (others: "
            f"{got.get('ddp')}): PyTorch's powerSGD_hook chains its all-reduces in future "
            "callbacks and fails on gloo with several buckets"]


def report(doc: dict[str, Any]) -> str:
    """The text printed and written beside the JSON: setup lines, table, verdicts."""
    m, cc = doc["meta"], doc["meta"]["comm_compute"]

    def ratio(x: float | None) -> str:
        return f"{x:.2f} : 1" if x is not None else "-"

    load = f"{m['loadavg_start'][0]:.2f} at the start, {m['loadavg_end'][0]:.2f} at the end"
    sync = m["sync_keyword"] or "none (the hook has one mode)"
    lines = [
        f"link: {m['bandwidth_mbit']:g} Mbit/s each way, measured goodput "
        f"{m['goodput']['mbit_per_s']:.0f} Mbit/s; {m['world']} workers; model "
        f"{m['params'] / 1e6:.2f} M parameters ({m['grad_bytes'] / 1e6:.1f} MB of fp32 gradient)",
        f"comm : compute of a dense step: {ratio(cc['ratio'])} measured ({cc['dense_config']} "
        f"minus the floor, over the floor); {ratio(cc['allreduce_alone_ratio'])} for a dense "
        f"all-reduce alone; {ratio(cc['line_rate_ratio'])} at line rate",
        f"load average: {load}; gradzip synchronous-mode keyword: {sync}",
        f"{m['rounds']} rounds of {m['steps']} steps per configuration (order rotating); a "
        "step is the slowest rank's; ratios are medians of per-round ratios",
        *builtin_powersgd_note(doc["rows"]),
        "",
        markdown_table(doc["rows"]),
        "",
        *(verdict_line(v) for v in doc["verdicts"]),
    ]
    return "\n".join(lines)
