"""Quality under HSDP against DDP: digits or the LM transformer, 4 gloo workers.

Each run trains a task (``--task digits``, the runner's defaults; or ``--task lm``, the small
transformer of ``benchmarks/outer.py`` on a word-level corpus, ``--data DIR``) with 4 processes, either as DDP (``gradzip.ddp`` over all 4)
or as HSDP 2 x 2 (``--hsdp 2``: FSDP2 inside 2 islands of 2, ``gradzip.fsdp`` across the
islands), with ``none`` and PowerSGD, over a few seeds; it records the final test accuracy
and the bytes each worker's engine sent (DDP: the all-reduce over 4 ranks; HSDP: the
exchange of its shards over 2 replicas only, the reduce-scatter inside the island being
FSDP2's).

    python -m benchmarks.hsdp_quality            # writes benchmarks/results/hsdp_quality.json
    python -m benchmarks.hsdp_quality --specs topk:ratio=0.01 --out R/hsdp_quality_topk.json
    python -m benchmarks.hsdp_quality --task lm --data CORPUS --seeds 2 \
        --specs none powersgd:rank=2 topk:ratio=0.01 --out R/hsdp_quality_lm.json

``CORPUS`` holds ``train.txt`` and ``valid.txt`` (``benchmarks/outer.py --source ... --corpus``
writes one from the WikiText-2 files).
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
#: The metric each task reports at its end.
METRIC = {"digits": "accuracy", "lm": "perplexity"}
#: The LM task's options: the transformer and inner optimizer of ``benchmarks/outer.py``,
#: one epoch of its corpus.
LM: dict[str, Any] = {"model": "transformer:dim=64,layers=2,heads=4", "optimizer": "adamw",
                      "lr": 1e-3, "weight_decay": 0.1, "clip": 1.0, "warmup_epochs": 0,
                      "epochs": 1, "batch_size": 18, "bptt": 38}


def _one(task: str, data: str | None, mode: str, spec: str, seed: int,
         folder: Path) -> dict[str, Any]:
    out = folder / f"{mode.replace(' ', '-')}-{spec.replace(':', '-')}-{seed}"
    extra = {**LM, "data": data} if task == "lm" else {}
    summary = run(RunConfig(task=task, workers=4, launcher="procs", compressor=spec,
                            seed=seed, hsdp=MODES[mode], threads=1, out=str(out), timeout=3600,
                            **extra))
    metric = METRIC[task]
    return {"mode": mode, "compressor": spec, "seed": seed,
            f"final_{metric}": summary[f"final_{metric}"],
            "bytes_sent_per_worker": summary["bytes_sent_per_worker"],
            "dense_bytes_per_worker": summary["dense_bytes_per_worker"],
            "steps": summary["steps"], "train_seconds": summary["train_seconds"]}


def summarize(runs: list[dict[str, Any]], metric: str = "accuracy") -> list[dict[str, Any]]:
    """Per (mode, compressor): the seeds' final ``metric``, their mean and spread (max - min),
    and the bytes per worker (the same for every seed)."""
    rows = []
    specs = list(dict.fromkeys(r["compressor"] for r in runs))
    for mode in MODES:
        for spec in specs:
            mine = [r for r in runs if r["mode"] == mode and r["compressor"] == spec]
            if not mine:
                continue
            got = [r[f"final_{metric}"] for r in mine]
            rows.append({"mode": mode, "compressor": spec, "seeds": len(mine),
                         f"{metric}_mean": statistics.fmean(got),
                         f"{metric}_spread": max(got) - min(got), f"{metric}_values": got,
                         "bytes_sent_per_worker": mine[0]["bytes_sent_per_worker"]})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds per configuration (default 3)")
    parser.add_argument("--out", type=Path, default=RESULTS / "hsdp_quality.json")
    parser.add_argument("--task", choices=sorted(METRIC), default="digits")
    parser.add_argument("--data", default=None, help="lm: a directory with train.txt and valid.txt")
    parser.add_argument("--specs", nargs="+", default=list(SPECS),
                        help=f"compressor specs (default: {' '.join(SPECS)})")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {args.seeds}")
    if args.task == "lm" and args.data is None:
        parser.error("--task lm needs --data (a directory with train.txt and valid.txt)")
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        for seed in range(args.seeds):
            for mode in MODES:
                for spec in args.specs:
                    runs.append(_one(args.task, args.data, mode, spec, seed, Path(folder)))
                    print(json.dumps(runs[-1]), flush=True)
    what = ("digits (runner defaults: 12 epochs, batch 16 per worker)" if args.task == "digits"
            else f"lm: {LM['model']}, one epoch of {args.data}, batch {LM['batch_size']} per worker")
    result = {"task": what, "workers": 4, "runs": runs,
              "summary": summarize(runs, METRIC[args.task])}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for row in result["summary"]:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
