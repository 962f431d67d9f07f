"""Validate the cost model (`gradzip plan`) against step times measured over capped links.

Reads the committed measurements of the emulated-network benchmarks and predicts each row's
time per step with :mod:`gradzip.plan`, from the row's own inputs only: the link's measured
goodput, the workers, the model's shapes, the compute time per step measured by the
benchmark without communication, the small all-reduce latency it measured (as the round trip),
the DDP bucket count and overlap mode. Compression times come from the plan's
micro-benchmark on this machine (cached in ``--timings``), multiplied by ``W / cores`` when
the benchmark ran more workers than the machine had cores (they shared them).

Sources (benchmarks/results/):

* ``netem_steps.json``, ``netem_steps_auto_now.json``: 2 workers, a 3.9M CNN, ~1.2 Gbit/s,
  several buckets, overlapped and synchronous hooks; compute = the ``floor`` row.
* ``netem.json``, ``netem_tta.json``: 4 workers, a 0.9M CNN, 1000/150/40 Mbit/s, one bucket;
  compute = each run's own measurement; Accordion rows as the mix of its two levels by the
  share of the run's measured traffic that its critical level accounts for (the share of
  critical tensors understates it when the critical tensors are the large ones; that
  prediction is kept beside it).
* ``netem_quiet.json``: the grid of ``netem.json`` again, later code, on an otherwise idle
  machine (``netem.json`` ran at load 3-9).
* ``outer_netem.json``: 4 workers, the transformer LM, 40/150 Mbit/s, per-step and DiLoCo
  H=30; it recorded no compute time, so each link's compute is calibrated from its SparseLoCo
  row (whose exchange is ~0.1 MB per 30 steps); that row is not scored.
* ``auto_netem.json``, ``auto_netem_rtt.json``: 2 workers, the same LM, 1000/150/40/10 Mbit/s
  (and 40 Mbit/s with a 100 ms round trip), per seed; compute calibrated from the DiLoCo
  H=30 row (not scored); ``none``, PowerSGD rank 4, and ``auto`` as the mix of the levels it
  ran.
* ``auto_netem_one_pass_fixed.json`` (2 workers, 1000/150/40 Mbit/s) and
  ``auto_netem_w4_grid.json`` (4 workers, 1000/150/40/10 Mbit/s): the same, for DiLoCo with
  the 8-bit exchange at H=10 and 30 (their ``auto`` runs switched to outer steps: not
  scored).

Writes ``benchmarks/results/plan_validation.{json,md}``: per row the prediction, the
measurement and the error; the target is every row within 25%.

    python -m benchmarks.plan_validation
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

from gradzip.plan import Candidate, Setting, TimingCache, measure_traffic, predict_candidate
from gradzip.plan.candidates import default_candidates
from gradzip.plan.command import model_shapes

from . import netem_steps_worker, netem_worker
from ._netlab import machine_info

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TARGET = 0.25

NETEM_SPECS = {"none": "none", "native": "none", "powersgd-r1": "powersgd:rank=1",
               "powersgd-r4": "powersgd:rank=4", "topk": "topk:ratio=0.01",
               "threshold": "threshold:budget=0.01"}
OUTER = {"none": ("none", 0), "topk1": ("topk:ratio=0.01", 0),
         "powersgd4": ("powersgd:rank=4", 0), "diloco30": ("none", 30),
         "diloco30-8bit": ("scatterq:bits=8", 30),
         "sparseloco30": ("chunktopk:chunk=4096,k=64,bits=2,average=senders", 30)}


class Model:
    """One model's shapes, with its traffic and compression times memoised."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], cache: TimingCache,
                 share: float) -> None:
        self.shapes, self.cache, self.share = shapes, cache, share
        self._traffic: dict[tuple[str, int], Any] = {}

    def traffic(self, spec: str, workers: int) -> Any:
        if (spec, workers) not in self._traffic:
            self._traffic[spec, workers] = measure_traffic(spec, workers, shapes=self.shapes)
        return self._traffic[spec, workers]

    def predict_ms(self, spec: str, setting: Setting, *, outer_steps: int = 0,
                   native: bool = False) -> tuple[float, int]:
        """Predicted ms per step and wire bytes per exchange; ``native``: PyTorch's own hook
        (no gradzip compression time)."""
        quality = "outer" if outer_steps else "lossless"
        cand = Candidate(spec, spec, quality, outer_steps)
        seconds = 0.0 if native else self.cache.seconds(spec, self.shapes) * self.share  # type: ignore[operator]
        traffic = self.traffic(spec, setting.workers)
        p = predict_candidate(cand, traffic, setting, seconds)
        return p.step_ms, p.wire_bytes


def _row(source: str, label: str, link: float, predicted: float, measured: float,
         **extra: Any) -> dict[str, Any]:
    err = predicted / measured - 1
    return {"source": source, "row": label, "bandwidth_mbit": link, "predicted_ms": predicted,
            "measured_ms": measured, "error": err, "met": abs(err) <= TARGET, **extra}


def _share(meta: dict[str, Any], workers: int) -> float:
    return max(1.0, workers / int(meta.get("machine", {}).get("cores") or workers))


def netem_steps(name: str, cache: TimingCache) -> list[dict[str, Any]]:
    d = json.loads((RESULTS / name).read_text())
    meta, w = d["meta"], d["meta"]["world"]
    args = meta["args"]
    model = Model({n: tuple(p.shape) for n, p in
                   netem_steps_worker.build_model(args["width"], 0).named_parameters()},
                  cache, _share(meta, w))
    rows = {r["config"]: r for r in d["rows"]}
    compute = rows["floor"]["ms_per_step"]
    bw = meta["goodput"]["mbit_per_s"]
    out = []
    for config, spec, native in [("ddp", "none", True), ("torch-fp16", "fp16", True),
                                 ("gradzip-none", "none", False),
                                 ("gradzip-none-sync", "none", False),
                                 ("gradzip-fp16", "fp16", False),
                                 ("gradzip-fp16-sync", "fp16", False),
                                 ("gradzip-powersgd-r4", "powersgd:rank=4", False),
                                 ("gradzip-powersgd-r4-sync", "powersgd:rank=4", False)]:
        if config not in rows:
            continue
        r = rows[config]
        setting = Setting(w, bw, 0.0, compute, buckets=r["buckets"] or 1,
                          overlap=not config.endswith("-sync"))
        pred, wire = model.predict_ms(spec, setting, native=native)
        out.append(_row(name, config, meta["bandwidth_mbit"], pred, r["ms_per_step"],
                        compute_ms=compute, buckets=setting.buckets, overlap=setting.overlap,
                        predicted_wire_bytes=wire, measured_wire_bytes=r["hook_wire_bytes_per_step"]))
    return out


def _mix(tensor_share: float, measured_wire: float | None, steady: float, critical: float,
         steady_wire: float, critical_wire: float, extra: dict[str, Any]) -> float:
    """An Accordion row's prediction: the mix of its two levels' step times, weighted by the
    share of the run's traffic that went at the critical level (from the measured wire bytes
    per step between the two levels' predicted ones, clamped to [0, 1]), where it was
    measured; else by the run's share of critical tensors. The share of tensors understates
    the critical level when the critical tensors are the large ones; both predictions are
    kept in ``extra``."""
    by_tensors = tensor_share * critical + (1 - tensor_share) * steady
    extra["predicted_ms_by_tensor_share"] = by_tensors
    if measured_wire is None or critical_wire == steady_wire:
        return by_tensors
    share = min(1.0, max(0.0, (measured_wire - steady_wire) / (critical_wire - steady_wire)))
    extra["critical_share_of_traffic"] = share
    return share * critical + (1 - share) * steady


def netem(name: str, cache: TimingCache) -> list[dict[str, Any]]:
    d = json.loads((RESULTS / name).read_text())
    meta, args = d["meta"], d["meta"]["args"]
    w = args["workers"]
    shapes = {n: tuple(p.shape) for n, p in
              netem_worker.build_model(args["width"], args["seed"]).named_parameters()}
    model = Model(shapes, cache, _share(meta, w))
    buckets = max(1, -(-4 * sum(_numel(s) for s in shapes.values())
                       // int(args.get("bucket_cap_mb", 25.0) * 2**20)))
    out = []
    for s in d["summary"]:
        method, link = s["method"], s["bandwidth_mbit"]
        bw = meta["goodput"][f"{link:g}"]["mbit_per_s"]
        compute = 1e3 * s["compute_seconds"]
        # The measured latency of one tiny all-reduce (2 (W-1) hops of a round trip each).
        rtt = 1e3 * s["allreduce_latency_seconds"] / (2 * (w - 1))
        setting = Setting(w, bw, rtt, compute, buckets=buckets)
        extra: dict[str, Any] = {}
        if method.startswith("accordion"):
            steady, steady_wire = model.predict_ms(args["steady"], setting)
            critical, critical_wire = model.predict_ms(args["critical"], setting)
            wire = None  # Accordion is not a plan candidate: no traffic of its own predicted
            pred = _mix(s["critical_fraction"], s["wire_bytes_per_step"], steady, critical,
                        steady_wire, critical_wire, extra)
        else:
            pred, wire = model.predict_ms(NETEM_SPECS[method], setting, native=method == "native")
        out.append(_row(name, method, link, pred, 1e3 * s["median_step_seconds"],
                        compute_ms=compute, rtt_ms=rtt, buckets=buckets,
                        predicted_wire_bytes=wire, measured_wire_bytes=s["wire_bytes_per_step"],
                        **extra))
    return out


def _outer_shapes(bytes_per_sync: float, workers: int) -> dict[str, tuple[int, ...]]:
    """The LM transformer's shapes, its vocabulary solved from the measured fp32 exchange."""
    spec = "transformer:dim=64,layers=2,heads=4"
    a, b = (sum(_numel(s) for s in model_shapes(spec, v).values()) for v in (1000, 2000))
    params = bytes_per_sync / (2 * (workers - 1) / workers) / 4
    vocab = round(1000 + (params - a) / ((b - a) / 1000))
    return model_shapes(spec, vocab)


def outer_netem(cache: TimingCache) -> list[dict[str, Any]]:
    d = json.loads((RESULTS / "outer_netem.json").read_text())
    meta, w = d["meta"], d["meta"]["args"]["workers"]
    rows = d["rows"]
    none = next(r for r in rows if r["method"] == "none")
    model = Model(_outer_shapes(none["bytes_per_worker_per_sync"], w), cache, _share(meta, w))
    out = []
    for link in sorted({r["bandwidth_mbit"] for r in rows}):
        bw = meta["goodput"][f"{link:g}"]["mbit_per_s"]
        here = {r["method"]: r for r in rows if r["bandwidth_mbit"] == link}
        cal = here["sparseloco30"]
        spec, h = OUTER["sparseloco30"]
        probe = Setting(w, bw, 0.0, 1.0)
        overhead = model.predict_ms(spec, probe, outer_steps=h)[0] - 1.0
        compute = 1e3 * cal["seconds_per_step"] - overhead
        setting = Setting(w, bw, 0.0, compute)
        for method, (spec, h) in OUTER.items():
            if method == "sparseloco30" or method not in here:
                continue
            pred, wire = model.predict_ms(spec, setting, outer_steps=h)
            out.append(_row("outer_netem.json", method, link, pred,
                            1e3 * here[method]["seconds_per_step"], compute_ms=compute,
                            compute_from="sparseloco30 row", predicted_wire_bytes=wire,
                            measured_wire_bytes=here[method]["bytes_per_worker_per_sync"]))
    return out


#: ``auto``'s default levels by the label its records use.
#: ``auto``'s level labels (as its records name them) -> their specs: the per-step candidates
#: of a plan carry the same labels.
AUTO_LEVELS = {c.name: c.spec for c in default_candidates() if not c.outer_steps}


#: The static configurations of an ``auto_netem.py`` run that are scored: method -> (spec, H).
AUTO_STATIC = {"none": ("none", 0), "powersgd4": ("powersgd:rank=4", 0),
               "diloco10-8bit-default": ("scatterq:bits=8", 10),
               "diloco30-8bit-default": ("scatterq:bits=8", 30)}


def auto_netem(name: str, cache: TimingCache) -> list[dict[str, Any]]:
    """The fixed links of an ``auto_netem.py`` run: each (seed, link)'s compute calibrated from
    its DiLoCo fp32 H=30 row, then the other static configurations predicted
    (:data:`AUTO_STATIC`: per-step ``none`` and PowerSGD rank 4, DiLoCo with the 8-bit exchange
    at H=10 and 30), and per-step ``auto`` as the mix of the levels it ran, by its steps at
    each."""
    d = json.loads((RESULTS / name).read_text())
    meta, w = d["meta"], d["meta"]["args"]["workers"]
    rtt_added = float(meta["args"].get("rtt_ms") or 0.0)
    rows = [r for r in d["rows"] if "error" not in r and "@" not in r["link"]]
    runs = {(r["seed"], r["link"], r["method"]): r for r in d["runs"]}
    # The model's shapes from an fp32 exchange's bytes: per-step ``none``'s, else DiLoCo fp32's
    # (the same dense exchange, every 30 steps), in a run without ``none``.
    dense = (next((r for r in rows if r["method"] == "none"), None)
             or next(r for r in rows if r["method"] == "diloco30-default"))
    model = Model(_outer_shapes(dense["bytes_per_worker_per_sync"], w), cache, _share(meta, w))
    out = []
    for seed, link in dict.fromkeys((r["seed"], r["link"]) for r in rows):
        here = {r["method"]: r for r in rows if (r["seed"], r["link"]) == (seed, link)}
        if "diloco30-default" not in here:
            continue
        bw = meta["goodput"][link]["mbit_per_s"]
        # Without an added delay the lab's round trip is well under a millisecond (taken as
        # 0, as for outer_netem.json); with one, the round trip measured on the link.
        rtt = meta["rtt"][link]["median_ms"] if rtt_added else 0.0
        probe = Setting(w, bw, rtt, 1.0)
        overhead = model.predict_ms("none", probe, outer_steps=30)[0] - 1.0
        compute = 1e3 * here["diloco30-default"]["seconds_per_step"] - overhead
        setting = Setting(w, bw, rtt, compute)
        for method, (spec, h) in AUTO_STATIC.items():
            if method in here:
                pred, wire = model.predict_ms(spec, setting, outer_steps=h)
                out.append(_row(name, f"{method} (seed {seed})", float(link), pred,
                                1e3 * here[method]["seconds_per_step"], compute_ms=compute,
                                rtt_ms=rtt, compute_from="diloco30-default row",
                                predicted_wire_bytes=wire,
                                measured_wire_bytes=here[method]["bytes_per_worker_per_sync"]))
        # Per-step auto only: a run that switched to outer steps is not a mix of levels.
        for method in (m for m in here if m.startswith("auto") and "outer" not in m):
            steps = runs[seed, link, method]["evaluations"][-1]["level_steps"]
            total = sum(steps.values())
            pred = sum(n * model.predict_ms(AUTO_LEVELS[lv], setting)[0]
                       for lv, n in steps.items() if n) / total
            out.append(_row(name, f"{method} (seed {seed}, mix)", float(link), pred,
                            1e3 * here[method]["seconds_per_step"], compute_ms=compute,
                            rtt_ms=rtt, compute_from="diloco30-default row",
                            predicted_wire_bytes=None,
                            measured_wire_bytes=here[method]["bytes_per_worker_per_sync"]))
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _by_tensor_share(rows: list[dict[str, Any]]) -> str:
    """The Accordion rows' errors had they been predicted by the share of critical tensors."""
    return ", ".join(f"{r['predicted_ms_by_tensor_share'] / r['measured_ms'] - 1:+.1%}"
                     for r in rows if "predicted_ms_by_tensor_share" in r)


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    met = sum(r["met"] for r in rows)
    errs = [abs(r["error"]) for r in rows]
    plain = [r for r in rows if not r["row"].startswith("accordion")]
    lines = [f"Predicted vs measured time per step: {met} of {len(rows)} rows within "
             f"{TARGET:.0%} (median |error| {statistics.median(errs):.1%}, worst "
             f"{max(errs):.1%}); without the Accordion rows (not a plan candidate; predicted "
             f"as a mix of its two levels by the share of the run's traffic sent at the "
             f"critical level): {sum(r['met'] for r in plain)} of {len(plain)}. Accordion "
             f"rows by the run's share of critical tensors instead: "
             f"{_by_tensor_share(rows)}. Compression times: the plan's "
             f"micro-benchmark (CPU time) on {meta['cpu']}, load average "
             f"{meta['loadavg_start'][0]:.2f}; see the module docstring for the inputs.",
             "", "| source | row | Mbit/s | compute ms | predicted ms | measured ms | error | "
             "within 25% | wire bytes predicted / measured |", "|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        pw, mw = r["predicted_wire_bytes"], r["measured_wire_bytes"]
        wire = f"{'-' if pw is None else f'{pw:,}'} / {'-' if mw is None else f'{mw:,.0f}'}"
        lines.append(f"| {r['source']} | {r['row']} | {r['bandwidth_mbit']:g} | "
                     f"{r['compute_ms']:.1f} | {r['predicted_ms']:.1f} | {r['measured_ms']:.1f} | "
                     f"{r['error']:+.1%} | {'met' if r['met'] else 'MISSED'} | {wire} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--timings", default=str(RESULTS / "plan_validation_timings.json"),
                   help="the compression-time cache (measured where missing)")
    p.add_argument("--out", default=str(RESULTS / "plan_validation"))
    args = p.parse_args(argv)
    cache = TimingCache(args.timings)
    load = os.getloadavg()
    rows = (netem_steps("netem_steps.json", cache) + netem_steps("netem_steps_auto_now.json", cache)
            + netem("netem.json", cache) + netem("netem_tta.json", cache)
            + netem("netem_quiet.json", cache) + outer_netem(cache)
            + [row for name in ("auto_netem.json", "auto_netem_rtt.json",
                                "auto_netem_one_pass_fixed.json", "auto_netem_w4_grid.json")
               if (RESULTS / name).exists() for row in auto_netem(name, cache)])
    meta = {**machine_info(), "loadavg": list(os.getloadavg()), "loadavg_start": list(load),
            "target": TARGET, "timings": os.path.relpath(args.timings, HERE.parent)}
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    Path(args.out + ".md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
