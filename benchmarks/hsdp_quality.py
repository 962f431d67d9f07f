"""Quality under HSDP against DDP: digits, 4 gloo workers, the runner's defaults.

Each run trains the digits task with 4 processes, either as DDP (``gradzip.ddp`` over all 4)
or as HSDP 2 x 2 (``--hsdp 2``: FSDP2 inside 2 islands of 2, ``gradzip.fsdp`` across the
islands), with ``none`` and PowerSGD, over a few seeds; it records the final test accuracy
and the bytes each worker's engine sent (DDP: the all-reduce over 4 ranks; HSDP: the
exchange of its shards over 2 replicas only, the reduce-scatter inside the island being
FSDP2's).

    python -m benchmarks.hsdp_quality            # writes benchmarks/results/hsdp_quality.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS
from gradzip.train.runner import RunConfig, run

SPECS = ("none", "powersgd:rank=2")
MODES = {"ddp": 0, "hsdp 2x2": 2}


def _one(mode: str, spec: str, seed: int, folder: Path) -> dict[str, Any]:
    out = folder / f"{mode.replace(' ', '-')}-{spec.replace(':', '-')}-{seed}"
    summary = run(RunConfig(task="digits", workers=4, launcher="procs", compressor=spec,
                            seed=seed, hsdp=MODES[mode], threads=1, out=str(out), timeout=1800))
    return {"mode": mode, "compressor": spec, "seed": seed,
            "final_accuracy": summary["final_accuracy"],
            "bytes_sent_per_worker": summary["bytes_sent_per_worker"],
            "dense_bytes_per_worker": summary["dense_bytes_per_worker"],
            "steps": summary["steps"], "train_seconds": summary["train_seconds"]}


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (mode, compressor): the seeds' accuracies, their mean and spread (max - min), and
    the bytes per worker (the same for every seed)."""
    rows = []
    for mode in MODES:
        for spec in SPECS:
            mine = [r for r in runs if r["mode"] == mode and r["compressor"] == spec]
            if not mine:
                continue
            acc = [r["final_accuracy"] for r in mine]
            rows.append({"mode": mode, "compressor": spec, "seeds": len(mine),
                         "accuracy_mean": statistics.fmean(acc), "accuracy_spread": max(acc) - min(acc),
                         "accuracies": acc, "bytes_sent_per_worker": mine[0]["bytes_sent_per_worker"]})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds per configuration (default 3)")
    parser.add_argument("--out", type=Path, default=RESULTS / "hsdp_quality.json")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {args.seeds}")
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        for seed in range(args.seeds):
            for mode in MODES:
                for spec in SPECS:
                    runs.append(_one(mode, spec, seed, Path(folder)))
                    print(json.dumps(runs[-1]), flush=True)
    result = {"task": "digits (runner defaults: 12 epochs, batch 16 per worker)", "workers": 4,
              "runs": runs, "summary": summarize(runs)}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for row in result["summary"]:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
