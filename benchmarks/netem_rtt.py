"""What a round trip adds to a training step over a capped link: measured, and as predicted.

Reads runs of ``benchmarks/outer_netem.py`` made on the same link once without a round trip
and once with one (``--rtt-ms``: the lab's delay line, ``benchmarks/netem_delay.py``), and puts
each (round trip, method) row's measured seconds per step beside the cost model's prediction
(:mod:`gradzip.plan`, the function behind ``gradzip plan``) for the same setting:

* the model: the LM transformer's shapes, its vocabulary solved from the measured dense
  exchange (as ``plan_validation.py`` does);
* the link: the goodput measured without the round trip (the line rate; the check with the
  round trip also pays TCP's slow start, and is reported beside it), and the configured round
  trip as the plan's ``--rtt-ms``;
* compute: calibrated per run from its DiLoCo row (measured step time less the plan's
  exchange per H steps), so that load drifting between the runs moves compute, not the
  comparison; those rows are therefore not scored.

It reports, per method, the step time each round trip measured and the plan predicted, and
what the round trip added (measured difference against predicted difference). With
``--probes`` (results of ``netem_rtt_probe.py`` without and with the round trip) it adds the
exchanges alone, compute replaced by a sleep: each exchange's measured time against the plan's
link time at the probe's goodput without a round trip.

    python -m benchmarks.netem_rtt --runs A.json B.json --probes C.json D.json \
        --out benchmarks/results/netem_rtt
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from gradzip.plan import Setting, TimingCache, comm_seconds

from ._netlab import machine_info
from .plan_validation import OUTER, TARGET, Model, _outer_shapes, _share

HERE = Path(__file__).resolve().parent
#: The row whose measurement calibrates each run's compute time.
CALIBRATION = "diloco30"


def _load(path: Path) -> dict[str, Any]:
    doc = json.loads(path.read_text())
    args = doc["meta"]["args"]
    if len(args["bandwidth_mbit"]) != 1:
        raise ValueError(f"`--runs` must each hold one link, got {args['bandwidth_mbit']} in {path}")
    rtt = float(args.get("rtt_ms", 0.0))
    return {"path": str(path), "rtt_ms": rtt, "doc": doc, "link": args["bandwidth_mbit"][0],
            "workers": args["workers"]}


def compare(paths: list[Path], cache: TimingCache) -> dict[str, Any]:
    """Measured and predicted rows of every run, and the round trip's added time per method.

    Raises:
        ValueError: the runs are not one without a round trip and others on the same link
            and workers, each with a :data:`CALIBRATION` row.
    """
    runs = sorted((_load(p) for p in paths), key=lambda r: r["rtt_ms"])
    base = runs[0]
    if base["rtt_ms"] != 0 or len(runs) < 2:
        raise ValueError(f"`--runs` must include one run with --rtt-ms 0 and one with a round "
                         f"trip, got round trips {[r['rtt_ms'] for r in runs]}")
    if len({(r["link"], r["workers"]) for r in runs}) != 1:
        raise ValueError("`--runs` must share one link and one number of workers")
    w, link = base["workers"], base["link"]
    bw = base["doc"]["meta"]["goodput"][f"{link:g}"]["mbit_per_s"]
    none = next(r for r in base["doc"]["rows"] if r["method"] == "none")
    model = Model(_outer_shapes(none["bytes_per_worker_per_sync"], w), cache,
                  _share(base["doc"]["meta"], w))
    rows: list[dict[str, Any]] = []
    for run in runs:
        meta, rtt = run["doc"]["meta"], run["rtt_ms"]
        here = {r["method"]: r for r in run["doc"]["rows"] if "error" not in r}
        if CALIBRATION not in here:
            raise ValueError(f"`--runs` must each hold a {CALIBRATION} row, got {run['path']}")
        spec, h = OUTER[CALIBRATION]
        overhead = model.predict_ms(spec, Setting(w, bw, rtt, 1.0), outer_steps=h)[0] - 1.0
        compute = 1e3 * here[CALIBRATION]["seconds_per_step"] - overhead
        setting = Setting(w, bw, rtt, compute)
        for method, r in here.items():
            spec, h = OUTER[method]
            predicted, wire = model.predict_ms(spec, setting, outer_steps=h)
            measured = 1e3 * r["seconds_per_step"]
            rows.append({
                "rtt_ms": rtt, "method": method, "label": r["label"], "compute_ms": compute,
                "predicted_ms": predicted, "measured_ms": measured,
                "error": predicted / measured - 1, "scored": method != CALIBRATION,
                "met": abs(predicted / measured - 1) <= TARGET, "steps": r["steps_run"],
                "predicted_wire_bytes": wire,
                "measured_wire_bytes": r["bytes_per_worker_per_sync"],
                "loadavg_after": r["loadavg_after"],
                "measured_rtt_ms": meta.get("rtt", {}).get(f"{link:g}", {}).get("min_ms"),
                "goodput_mbit": meta["goodput"][f"{link:g}"]["mbit_per_s"]})
    added = []
    for run in runs[1:]:
        for method in sorted({r["method"] for r in rows}):
            pair = [next((r for r in rows if r["method"] == method and r["rtt_ms"] == t), None)
                    for t in (0.0, run["rtt_ms"])]
            if None in pair:
                continue
            a, b = pair
            drift = b["compute_ms"] - a["compute_ms"]
            # The plan's added time at equal compute: its link terms alone.
            added.append({"rtt_ms": run["rtt_ms"], "method": method,
                          "measured_added_ms": b["measured_ms"] - a["measured_ms"],
                          "compute_drift_ms": drift,
                          "measured_added_less_drift_ms": b["measured_ms"] - a["measured_ms"] - drift,
                          "predicted_added_ms": (b["predicted_ms"] - b["compute_ms"])
                          - (a["predicted_ms"] - a["compute_ms"])})
    meta = {"machine": machine_info(), "workers": w, "link_mbit": link, "bandwidth_mbit": bw,
            "runs": [{"path": r["path"], "rtt_ms": r["rtt_ms"],
                      "delay_line": r["doc"]["meta"].get("delay_line"),
                      "rtt_probe": r["doc"]["meta"].get("rtt", {}).get(f"{link:g}"),
                      "goodput": r["doc"]["meta"]["goodput"][f"{link:g}"],
                      "loadavg_start": r["doc"]["meta"]["loadavg_start"],
                      "loadavg_end": r["doc"]["meta"].get("loadavg_end")} for r in runs],
            "loadavg": list(os.getloadavg()), "target": TARGET}
    return {"meta": meta, "rows": rows, "added": added}


def compare_probes(paths: list[Path]) -> list[dict[str, Any]]:
    """Per (round trip, method) of ``netem_rtt_probe.py`` results: the exchange measured, the
    plan's link time at the goodput measured without a round trip, and what the round trip
    added to each.

    Raises:
        ValueError: no probe without a round trip among ``paths``.
    """
    docs = sorted((json.loads(p.read_text()) for p in paths),
                  key=lambda d: d["meta"]["args"]["rtt_ms"])
    if not docs or docs[0]["meta"]["args"]["rtt_ms"] != 0:
        raise ValueError("`--probes` must include one run with --rtt-ms 0")
    bw = docs[0]["meta"]["goodput"]["mbit_per_s"]
    base = {r["method"]: r for r in docs[0]["rows"]}
    out = []
    for d in docs:
        rtt = float(d["meta"]["args"]["rtt_ms"])
        for r in d["rows"]:
            predicted = 1e3 * comm_seconds(r["wire_bytes"], r["hops"], bw, rtt)
            zero = 1e3 * comm_seconds(r["wire_bytes"], r["hops"], bw, 0.0)
            out.append({"rtt_ms": rtt, "method": r["method"], "calls": r["calls"],
                        "hops": r["hops"], "exchanges": r["exchanges"],
                        "compute_ms": d["meta"]["args"]["compute_ms"],
                        "measured_ms": r["exchange_ms_measured"], "predicted_ms": predicted,
                        "measured_added_ms": r["exchange_ms_measured"]
                        - base[r["method"]]["exchange_ms_measured"],
                        "predicted_added_ms": predicted - zero,
                        "delay_line": d["meta"].get("delay_line"),
                        "probe_rtt_ms": d["meta"]["rtt"]["min_ms"], "goodput_mbit": bw})
    return out


def markdown(doc: dict[str, Any]) -> str:
    """The two tables: step times measured and predicted, and what the round trip added."""
    meta = doc["meta"]
    lines = [f"{meta['workers']} workers, {meta['link_mbit']:g} Mbit/s (goodput "
             f"{meta['bandwidth_mbit']:.1f} Mbit/s without a round trip); compute calibrated "
             f"per run from its {CALIBRATION} row (not scored).", "",
             "| RTT ms | method | compute ms | predicted ms/step | measured ms/step | error | "
             "within 25% |", "|---:|---|---:|---:|---:|---:|---|"]
    for r in doc["rows"]:
        verdict = ("met" if r["met"] else "MISSED") if r["scored"] else "calibration"
        lines.append(f"| {r['rtt_ms']:g} | {r['label']} | {r['compute_ms']:.0f} | "
                     f"{r['predicted_ms']:.0f} | {r['measured_ms']:.0f} | {r['error']:+.1%} | "
                     f"{verdict} |")
    lines += ["", "| RTT ms | method | added per step, measured ms | compute drift between the "
              "runs ms | measured less drift ms | predicted (link terms) ms |",
              "|---:|---|---:|---:|---:|---:|"]
    for a in doc["added"]:
        lines.append(f"| {a['rtt_ms']:g} | {a['method']} | {a['measured_added_ms']:+.0f} | "
                     f"{a['compute_drift_ms']:+.0f} | {a['measured_added_less_drift_ms']:+.0f} | "
                     f"{a['predicted_added_ms']:+.0f} |")
    lines += ["", "| RTT ms | probe RTT min / median ms | goodput Mbit/s | delay line: packets, "
              "max backlog, late mean / max ms | load average start -> end |",
              "|---:|---|---:|---|---|"]
    for r in meta["runs"]:
        probe, dl = r["rtt_probe"] or {}, r["delay_line"]
        line = ("-" if not dl else f"{dl['packets']:,}, {dl['max_backlog']}, "
                f"{dl['late_mean_ms']:.2f} / {dl['late_max_ms']:.1f}")
        lines.append(f"| {r['rtt_ms']:g} | {probe.get('min_ms', float('nan')):.2f} / "
                     f"{probe.get('median_ms', float('nan')):.2f} | "
                     f"{r['goodput']['mbit_per_s']:.1f} | {line} | "
                     f"{r['loadavg_start'][0]:.1f} -> {(r['loadavg_end'] or [float('nan')])[0]:.1f} |")
    if doc.get("probes"):
        lines += ["", "Exchanges alone (compute replaced by a sleep; netem_rtt_probe.py):", "",
                  "| RTT ms | method | calls (hops) | exchanges timed | measured ms | predicted ms "
                  "| added by the RTT, measured / predicted ms | added / RTT |",
                  "|---:|---|---|---:|---:|---:|---|---:|"]
        for p in doc["probes"]:
            per = (f"{p['measured_added_ms'] / p['rtt_ms']:.2f}" if p["rtt_ms"] else "-")
            lines.append(f"| {p['rtt_ms']:g} | {p['method']} | {p['calls']} ({p['hops']}) | "
                         f"{p['exchanges']} | {p['measured_ms']:.0f} | {p['predicted_ms']:.0f} | "
                         f"{p['measured_added_ms']:+.0f} / {p['predicted_added_ms']:+.0f} | "
                         f"{per} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=Path, nargs="+", required=True,
                   help="outer_netem.py results: one with --rtt-ms 0, others with a round trip")
    p.add_argument("--probes", type=Path, nargs="*", default=[],
                   help="netem_rtt_probe.py results: one with --rtt-ms 0, others with one")
    p.add_argument("--timings", default=str(HERE / "results" / "plan_validation_timings.json"),
                   help="the compression-time cache (measured where missing)")
    p.add_argument("--out", default=str(HERE / "results" / "netem_rtt"))
    args = p.parse_args(argv)
    doc = compare(args.runs, TimingCache(args.timings))
    if args.probes:
        doc["probes"] = compare_probes(args.probes)
    Path(args.out + ".json").write_text(json.dumps(doc, indent=1))
    text = markdown(doc)
    Path(args.out + ".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
