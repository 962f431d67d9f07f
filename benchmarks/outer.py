"""Outer-step training against per-step averaging: final perplexity and bytes per worker.

Runs a small grid on a word-level corpus with the ``lm`` task's small transformer, 4 simulated
workers and inner AdamW: per-step ``none`` (the reference), DiLoCo with fp32 pseudo-gradients
(outer Nesterov, H = 30, and H = 100 for longer runs), the same with the 8-bit reduce-scatter/all-gather exchange
(``scatterq:bits=8``), the SparseLoCo-style mode (chunked Top-k, 2-bit values, decayed error
feedback in place of outer momentum, each coordinate averaged over its senders) and a per-step
compressor at bytes similar to DiLoCo's (Top-k 1% with error feedback), each over several
seeds. Every run is one ``gradzip train`` process (one at a time, one torch thread); a run
whose ``summary.json`` exists is skipped, so an interrupted benchmark resumes where it
stopped (seed-major order: every configuration gets its first seed before any gets a second).

Writes ``--results`` (default ``benchmarks/results/outer.json``): per run the final and best
validation perplexity, bytes sent per worker, exchanges and wall time; per configuration the
mean and range (min, max) over seeds, the ratios of bytes and perplexity to per-step ``none``
and to DiLoCo fp32, and the verdicts against the targets (DiLoCo within 3% of per-step
perplexity; SparseLoCo within 2% of DiLoCo at >= 50x fewer bytes).

``--corpus`` is a directory holding one ``*train*`` and one ``*valid*`` text file (or, with
``--source``, the script builds it: ``train.txt`` is the source's ``test.txt`` whole, and
``valid.txt`` the first lines of its ``valid.txt`` up to ``--valid-words`` words, which keeps
evaluation cheap on two cores).

Usage::

    python benchmarks/outer.py --source /tmp/wt2/wikitext-2-partial --corpus /tmp/wt2/corpus \\
        --runs /tmp/outer-runs --seeds 0 1 2
    python benchmarks/outer.py --corpus DIR --runs DIR --collect-only --archive runs.tar.gz
    python benchmarks/outer.py --corpus DIR --runs DIR --set epochs=10 \\
        --only none diloco30 sparseloco30 diloco100        # 900 steps: 30 and 9 syncs
    python benchmarks/outer.py --corpus DIR --runs DIR --dry-run        # print the commands
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

#: DiLoCo at H = 30 within this fraction of per-step ``none``'s final perplexity.
DILOCO_MAX_PPL_RATIO = 1.03
#: The SparseLoCo mode within this fraction of DiLoCo fp32's perplexity ...
SPARSELOCO_MAX_PPL_RATIO = 1.02
#: ... at this many times fewer bytes per worker, or more.
SPARSELOCO_MIN_BYTE_RATIO = 50.0


@dataclass(frozen=True)
class Config:
    """One configuration of the grid: a label and its ``gradzip train`` options."""

    key: str
    label: str
    options: dict[str, Any] = field(default_factory=dict)


#: DiLoCo's published outer step, passed explicitly: the runs of BENCHMARKS section 5 were made
#: with it, and the default now takes its momentum from H (``gradzip.outer_defaults``).
DILOCO: dict[str, Any] = {"outer-lr": 0.7, "outer-momentum": 0.9}

#: The grid, in run order within a seed (the configurations of the two targets first).
CONFIGS: tuple[Config, ...] = (
    Config("none", "per-step none", {"compressor": "none"}),
    Config("diloco30", "DiLoCo fp32 H=30", {"outer-steps": 30, **DILOCO}),
    Config("sparseloco30", "SparseLoCo H=30",
           {"outer-steps": 30, "outer-optimizer": "ef-momentum",
            "compressor": "chunktopk:chunk=4096,k=64,bits=2,average=senders"}),
    Config("diloco30-8bit", "DiLoCo 8-bit H=30",
           {"outer-steps": 30, "compressor": "scatterq:bits=8", **DILOCO}),
    Config("topk1", "per-step Top-k 1%", {"compressor": "topk:ratio=0.01"}),
    Config("diloco100", "DiLoCo fp32 H=100", {"outer-steps": 100, **DILOCO}),
)

#: Options shared by every run (the model and inner optimizer of the DiLoCo replications,
#: sized for two shared cores).
BASE: dict[str, Any] = {
    "task": "lm", "workers": 4, "launcher": "sim", "threads": 1,
    "model": "transformer:dim=64,layers=2,heads=4", "optimizer": "adamw", "lr": 1e-3,
    "weight-decay": 0.1, "clip": 1.0, "warmup-epochs": 0, "epochs": 3,
    # 18 columns of 38 tokens: 90 steps per epoch on WikiText-2's test.txt over 4 workers, so
    # 3 epochs end on a synchronisation at H = 30 (the final evaluation sees synced weights).
    "batch-size": 18, "bptt": 38, "checkpoint-every": 1,
}


def build_corpus(source: Path, corpus: Path, valid_words: int) -> Path:
    """Write ``corpus/train.txt`` (``source/test.txt`` whole) and a truncated ``valid.txt``.

    Args:
        source: A directory with WikiText-2's ``test.txt`` and ``valid.txt``.
        corpus: The directory to write (created; existing files are kept).
        valid_words: Whole lines of ``valid.txt`` are kept until this many words.

    Returns:
        ``corpus``.

    Raises:
        ValueError: If ``valid_words`` < 1 or a source file is missing.
    """
    if valid_words < 1:
        raise ValueError(f"`valid_words` must be >= 1, got {valid_words}")
    for name in ("test.txt", "valid.txt"):
        if not (source / name).is_file():
            raise ValueError(f"`source` must hold {name}, got {str(source)!r}")
    corpus.mkdir(parents=True, exist_ok=True)
    train, valid = corpus / "train.txt", corpus / "valid.txt"
    if not train.exists():
        train.write_text((source / "test.txt").read_text(encoding="utf-8"), encoding="utf-8")
    if not valid.exists():
        kept, words = [], 0
        with open(source / "valid.txt", encoding="utf-8") as fh:
            for line in fh:
                kept.append(line)
                words += len(line.split())
                if words >= valid_words:
                    break
        valid.write_text("".join(kept), encoding="utf-8")
    return corpus


def command(cfg: Config, seed: int, corpus: Path, out: Path,
            overrides: dict[str, Any]) -> list[str]:
    """The ``gradzip train`` command line of one run.

    Args:
        cfg: The configuration.
        seed: Its seed.
        corpus: The corpus directory (``--data``).
        out: The run directory.
        overrides: Options replacing :data:`BASE`'s (and the configuration's).

    Returns:
        The argument list, starting with the Python interpreter.
    """
    opts = {**BASE, **cfg.options, **overrides, "seed": seed, "data": str(corpus),
            "out": str(out)}
    args = [sys.executable, "-m", "gradzip", "train", "--quiet", "--no-scale-lr"]
    for key, value in opts.items():
        args += [f"--{key}"] if value is True else [f"--{key}", str(value)]  # True: a flag
    return args


def run_dir(runs: Path, cfg: Config, seed: int) -> Path:
    """The directory of one run."""
    return runs / f"{cfg.key}-s{seed}"


def run_grid(configs: tuple[Config, ...], seeds: list[int], corpus: Path, runs: Path,
             overrides: dict[str, Any], dry_run: bool = False) -> None:
    """Run every (seed, configuration) whose summary is missing, one process at a time.

    Args:
        configs: The configurations.
        seeds: The seeds, outer loop.
        corpus: The corpus directory.
        runs: Where the run directories go.
        overrides: Options replacing the base's.
        dry_run: Print the commands instead of running them.

    Raises:
        subprocess.CalledProcessError: If a run fails.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    for seed in seeds:
        for cfg in configs:
            out = run_dir(runs, cfg, seed)
            if (out / "summary.json").is_file():
                continue
            args = command(cfg, seed, corpus, out, overrides)
            if out.exists():  # an interrupted run continues from its checkpoint
                args.append("--resume")
            print(" ".join(args), flush=True)
            if not dry_run:
                subprocess.run(args, check=True, env=env)


def _stats(values: list[float]) -> dict[str, float]:
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def collect(configs: tuple[Config, ...], seeds: list[int], runs: Path) -> dict[str, Any]:
    """Gather the finished runs into per-run rows, per-configuration aggregates and verdicts.

    Args:
        configs: The configurations.
        seeds: The seeds looked for.
        runs: The run directories' parent.

    Returns:
        ``{"runs": [...], "configs": {key: {...}}, "verdicts": [...]}``; a configuration
        without a finished run is left out of ``configs``.
    """
    rows: list[dict[str, Any]] = []
    for cfg in configs:
        for seed in seeds:
            path = run_dir(runs, cfg, seed) / "summary.json"
            if not path.is_file():
                continue
            s = json.loads(path.read_text(encoding="utf-8"))
            rows.append({
                "config": cfg.key, "label": cfg.label, "seed": seed,
                "final_perplexity": s["final_perplexity"],
                "best_perplexity": s["best_perplexity"],
                "bytes_sent_per_worker": s["bytes_sent_per_worker"],
                "dense_bytes_per_worker": s["dense_bytes_per_worker"],
                "steps": s["steps"], "rounds": s["rounds"], "epochs": s["epochs"],
                "wall_seconds": s["wall_seconds"],
            })
    agg: dict[str, dict[str, Any]] = {}
    for cfg in configs:
        mine = [r for r in rows if r["config"] == cfg.key]
        if not mine:
            continue
        agg[cfg.key] = {
            "label": cfg.label, "options": cfg.options, "seeds": [r["seed"] for r in mine],
            "final_perplexity": _stats([r["final_perplexity"] for r in mine]),
            "bytes_sent_per_worker": _stats([r["bytes_sent_per_worker"] for r in mine]),
            "rounds": mine[0]["rounds"], "steps": mine[0]["steps"],
        }
    for ref in ("none", "diloco30"):
        if ref not in agg:
            continue
        for entry in agg.values():
            entry[f"ppl_over_{ref}"] = (entry["final_perplexity"]["mean"]
                                        / agg[ref]["final_perplexity"]["mean"])
            sent = entry["bytes_sent_per_worker"]["mean"]
            entry[f"bytes_fewer_than_{ref}"] = (
                agg[ref]["bytes_sent_per_worker"]["mean"] / sent if sent else math.inf)
    return {"runs": rows, "configs": agg, "verdicts": verdicts(agg)}


def verdicts(agg: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The two targets, decided from the seed means (a target lacking its runs is skipped).

    Args:
        agg: ``collect``'s per-configuration aggregates.

    Returns:
        One dict per decidable target: ``target``, ``met``, ``figure``.
    """
    out: list[dict[str, Any]] = []
    if "diloco30" in agg and "ppl_over_none" in agg["diloco30"]:
        ratio = agg["diloco30"]["ppl_over_none"]
        out.append({"target": "DiLoCo fp32 H=30 within 3% of per-step none's perplexity",
                    "met": ratio <= DILOCO_MAX_PPL_RATIO,
                    "figure": f"perplexity ratio {ratio:.4f}"})
    sl = agg.get("sparseloco30", {})
    if "ppl_over_diloco30" in sl:
        ratio, fewer = sl["ppl_over_diloco30"], sl["bytes_fewer_than_diloco30"]
        out.append({"target": "SparseLoCo within 2% of DiLoCo fp32 at >= 50x fewer bytes",
                    "met": ratio <= SPARSELOCO_MAX_PPL_RATIO
                    and fewer >= SPARSELOCO_MIN_BYTE_RATIO,
                    "figure": f"perplexity ratio {ratio:.4f} at {fewer:.1f}x fewer bytes"})
    return out


def markdown(result: dict[str, Any]) -> str:
    """A Markdown table of the aggregates (perplexity mean [min, max], bytes, ratios).

    Args:
        result: ``collect``'s result.

    Returns:
        The table, one line per configuration.
    """
    lines = ["| configuration | seeds | syncs | final perplexity, mean [min, max] | "
             "MB sent per worker | bytes: none / this | bytes: DiLoCo / this | "
             "ppl / none | ppl / DiLoCo |",
             "|---|---|---|---|---|---|---|---|---|"]
    for entry in result["configs"].values():
        p, b = entry["final_perplexity"], entry["bytes_sent_per_worker"]["mean"]
        lines.append(
            f"| {entry['label']} | {len(entry['seeds'])} | {entry['rounds']} | "
            f"{p['mean']:.1f} [{p['min']:.1f}, {p['max']:.1f}] | {b / 1e6:.3f} | "
            f"{entry.get('bytes_fewer_than_none', math.nan):.1f}x | "
            f"{entry.get('bytes_fewer_than_diloco30', math.nan):.2f}x | "
            f"{entry.get('ppl_over_none', math.nan):.4f} | "
            f"{entry.get('ppl_over_diloco30', math.nan):.4f} |")
    return "\n".join(lines)


def archive(configs: tuple[Config, ...], seeds: list[int], runs: Path, dest: Path) -> int:
    """Pack every finished run's ``summary.json`` and ``metrics.jsonl`` (no checkpoints).

    Args:
        configs: The configurations.
        seeds: The seeds looked for.
        runs: The run directories' parent.
        dest: The ``.tar.gz`` to write.

    Returns:
        The number of runs packed.
    """
    packed = 0
    with tarfile.open(dest, "w:gz") as tar:
        for cfg in configs:
            for seed in seeds:
                folder = run_dir(runs, cfg, seed)
                if not (folder / "summary.json").is_file():
                    continue
                for name in ("summary.json", "metrics.jsonl"):
                    if (folder / name).is_file():
                        tar.add(folder / name, arcname=f"{folder.name}/{name}")
                packed += 1
    return packed


def _sets(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"`--set` must be KEY=VALUE, got {item!r}")
        out[key.replace("_", "-")] = value
    return out


def main(argv: list[str] | None = None) -> int:
    """Run (or only collect) the grid and write the results file."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, required=True,
                   help="directory with a *train* and a *valid* text file")
    p.add_argument("--source", type=Path, default=None,
                   help="WikiText-2 directory (test.txt, valid.txt) to build --corpus from")
    p.add_argument("--valid-words", type=int, default=50_000,
                   help="with --source: words of valid.txt kept (whole lines)")
    p.add_argument("--runs", type=Path, required=True, help="run directories' parent")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--only", nargs="+", default=None,
                   help=f"configuration keys, of {[c.key for c in CONFIGS]}")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a gradzip train option for every run (e.g. epochs=1)")
    p.add_argument("--results", type=Path, default=HERE / "results" / "outer.json")
    p.add_argument("--archive", type=Path, default=None,
                   help="also pack the finished runs' summaries and metrics into this .tar.gz")
    p.add_argument("--collect-only", action="store_true", help="no runs, only the tables")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    configs = CONFIGS
    if args.only:
        unknown = sorted(set(args.only) - {c.key for c in CONFIGS})
        if unknown:
            p.error(f"`--only` must name configurations of {[c.key for c in CONFIGS]}, "
                    f"got {unknown}")
        configs = tuple(c for c in CONFIGS if c.key in args.only)
    overrides = _sets(args.set)
    if args.source is not None and not args.collect_only:
        build_corpus(args.source, args.corpus, args.valid_words)
    if not args.collect_only:
        run_grid(configs, args.seeds, args.corpus, args.runs, overrides, args.dry_run)
    if args.dry_run:
        return 0
    result = collect(configs, args.seeds, args.runs)
    result["setup"] = {"base": {**BASE, **overrides}, "seeds": args.seeds,
                       "corpus": str(args.corpus), "valid_words": args.valid_words}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    if args.archive is not None:
        archive(configs, args.seeds, args.runs, args.archive)
    print(markdown(result))
    for v in result["verdicts"]:
        print(f"{'met' if v['met'] else 'MISSED'}: {v['target']} ({v['figure']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
