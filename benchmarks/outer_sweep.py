"""Outer learning rate x outer momentum x H for DiLoCo-style training, on two small tasks.

Each run trains simulated workers (``--workers``, 4, for the CNN; ``--lm-workers``, 2, for the
LM, the costlier task on two shared cores) in one process with :class:`gradzip.Outer`
(Nesterov outer optimizer, fp32 exchange) for a fixed number of inner steps (the same for
every H, so H = 10, 30 and 100 see the same data and compute, and 60, 20 and 6
synchronisations at 600 steps), then evaluates the synchronised model:

* ``lm``: the project's small decoder-only transformer (dim 64, 1 layer, 4 heads, context
  32, no dropout) on characters of WikiText-2's ``test.txt`` (the first ``--lm-chars``
  characters; evaluated on the start of ``valid.txt``), inner AdamW (lr 3e-3, betas 0.9,
  0.95, weight decay 0.1, clip 1.0), batch 16 windows per worker. Metric: validation
  perplexity.
* ``cnn``: the digits CNN (:class:`~gradzip.train.models.DigitsNet`) on the 8x8 digits that
  ship with gradzip (80/20 split), inner SGD (lr 0.025, momentum 0.9, weight decay 1e-4),
  batch 16 per worker. Metric: test cross-entropy (accuracy is recorded too).

Every run writes ``<runs>/<key>.json``; a run whose file exists is skipped, so an interrupted
sweep resumes where it stopped. A ``default`` entry per H runs whatever
:class:`~gradzip.Outer` picks when no outer lr or momentum is passed (the H-dependent rule);
it shares its file with the grid point it resolves to, if any.

``--summary`` (default ``benchmarks/results/outer_sweep``) gets ``.json`` and ``.md``: per
(task, H, lr, momentum) the mean and range over seeds, the best setting per (task, H), the
verdict of the target (the default's mean metric within ``TOLERANCE``, 5%, of the best grid
setting's mean metric over the same seeds, at every H of both tasks), and :func:`fit`: the
setting per H that the data supports as a default.

Usage (the committed results: several processes at once, each on its own seeds or extra
learning rates, sharing one ``--runs`` directory; then one summary over all of it)::

    nice -n 15 python benchmarks/outer_sweep.py --runs /tmp/outer-sweep --tasks lm --seeds 0
    nice -n 15 python benchmarks/outer_sweep.py --runs /tmp/outer-sweep --tasks lm --hs 10 \
        --lrs 0.15 0.2 --momenta 0.9 --seeds 1
    python benchmarks/outer_sweep.py --runs /tmp/outer-sweep --collect-only --seeds 0 1 2 \
        --lrs 0.1 0.15 0.2 0.3 0.5 0.7 1.0 --momenta 0.5 0.9
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradzip import Outer, SimulatedGroup
from gradzip.outer.defaults import outer_defaults
from gradzip.train.data import load_digits
from gradzip.train.models import DigitsNet
from gradzip.train.transformer import TransformerLanguageModel

HERE = Path(__file__).resolve().parent
#: The default's metric within this fraction of the best grid setting's (mean over seeds).
TOLERANCE = 0.05
#: Where ``tar xzf ../shared/data/wikitext-2-partial.tar.gz -C /tmp/wt2`` puts the corpus.
CORPUS = Path("/tmp/wt2/wikitext-2-partial")


@dataclass(frozen=True)
class Grid:
    """The sweep's axes and run length."""

    tasks: tuple[str, ...] = ("lm", "cnn")
    hs: tuple[int, ...] = (10, 30, 100)
    lrs: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 1.0)
    momenta: tuple[float, ...] = (0.5, 0.9)
    steps: int = 600
    workers: int = 4
    lm_workers: int = 2
    batch: int = 16
    lm_chars: int = 200_000
    eval_chars: int = 16_384

    def workers_of(self, task: str) -> int:
        """The simulated workers of ``task``'s runs."""
        return self.lm_workers if task == "lm" else self.workers


def run_key(task: str, h: int, lr: float, momentum: float, seed: int) -> str:
    """The file stem of one run (lr and momentum as resolved, so the default shares a grid
    point's file)."""
    return f"{task}-H{h}-lr{lr:g}-m{momentum:g}-s{seed}"


# -- tasks -----------------------------------------------------------------------------------
class LMTask:
    """Character-level language modelling with the project's transformer."""

    context = 32

    def __init__(self, grid: Grid, corpus: Path) -> None:
        train = (corpus / "test.txt").read_text(encoding="utf-8")[: grid.lm_chars]
        valid = (corpus / "valid.txt").read_text(encoding="utf-8")[: grid.eval_chars]
        self.vocab = sorted(set(train))
        index = {c: i for i, c in enumerate(self.vocab)}
        self.train = torch.tensor([index[c] for c in train])
        self.valid = torch.tensor([index.get(c, 0) for c in valid])
        self.batch = grid.batch

    def model(self) -> nn.Module:
        return TransformerLanguageModel(len(self.vocab), dim=64, layers=1, heads=4,
                                        context=self.context, dropout=0.0)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)

    def batch_of(self, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        starts = torch.randint(0, len(self.train) - self.context - 1, (self.batch,), generator=gen)
        rows = torch.stack([self.train[s: s + self.context + 1] for s in starts.tolist()], dim=1)
        return rows[:-1], rows[1:]  # [T, B]

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        logits, _ = model(x, model.init_hidden(x.shape[1]))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        n = (len(self.valid) - 1) // self.context
        x = self.valid[: n * self.context].view(n, self.context).t()
        y = self.valid[1: n * self.context + 1].view(n, self.context).t()
        loss = float(self.loss(model, (x, y)))
        return {"loss": loss, "metric": math.exp(loss)}


class CNNTask:
    """The embedded 8x8 digits with the digits CNN."""

    def __init__(self, grid: Grid) -> None:
        data = load_digits(seed=0)
        self.train, self.test, self.batch = data.train, data.test, grid.batch

    def model(self) -> nn.Module:
        return DigitsNet()

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.025, momentum=0.9, weight_decay=1e-4)

    def batch_of(self, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        idx = torch.randint(0, len(self.train.y), (self.batch,), generator=gen)
        return self.train.x[idx], self.train.y[idx]

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        return F.cross_entropy(model(batch[0]), batch[1])

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        logits = model(self.test.x)
        loss = float(F.cross_entropy(logits, self.test.y))
        acc = float((logits.argmax(1) == self.test.y).float().mean())
        return {"loss": loss, "metric": loss, "accuracy": acc}


def replicas(task: Any, grid: Grid, seed: int) -> tuple[list[nn.Module], list[Any],
                                                        list[torch.Generator]]:
    """The workers' equal models (seeded by ``seed``), their inner optimizers and their data
    generators."""
    torch.manual_seed(seed)
    first = task.model()
    workers = grid.workers_of("lm" if isinstance(task, LMTask) else "cnn")
    models = [first] + [type(first)(**_same_args(task)) for _ in range(workers - 1)]
    for m in models[1:]:
        m.load_state_dict(first.state_dict())
    inner = [task.optimizer(m) for m in models]
    gens = [torch.Generator().manual_seed(1000 * seed + w) for w in range(workers)]
    return models, inner, gens


def train_one(task: Any, grid: Grid, h: int, lr: float | None, momentum: float | None,
              seed: int) -> dict[str, Any]:
    """One run: ``grid.steps`` inner steps of every worker under :class:`~gradzip.Outer`.

    Args:
        task: an :class:`LMTask` or :class:`CNNTask`.
        grid: run length, workers and batch.
        h: inner steps between synchronisations.
        lr, momentum: the outer optimizer's, or ``None`` for the library's default.
        seed: model initialisation and data order.

    Returns:
        The run's record: resolved outer settings, final evaluation, wall seconds.
    """
    models, inner, gens = replicas(task, grid, seed)
    first, workers = models[0], len(models)
    outer = Outer(models, "none", inner_steps=h, outer_lr=lr, outer_momentum=momentum,
                  collective=SimulatedGroup(workers), inner_optimizers=inner)
    start = time.perf_counter()
    losses = []
    for _ in range(grid.steps):
        total = 0.0
        for model, opt, gen in zip(models, inner, gens, strict=True):
            opt.zero_grad(set_to_none=True)
            loss = task.loss(model, task.batch_of(gen))
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            total += float(loss.detach())
        losses.append(total / workers)
        outer.step()
    result = task.evaluate(first)
    tail = losses[-h:]
    return {"outer_lr": outer.optimizer.lr, "outer_momentum": outer.optimizer.momentum,
            "syncs": outer.syncs, "train_loss_last_round": sum(tail) / len(tail),
            **result, "finite": math.isfinite(result["loss"]),
            "wall_seconds": time.perf_counter() - start}


def _same_args(task: Any) -> dict[str, Any]:
    if isinstance(task, LMTask):
        return {"vocab_size": len(task.vocab), "dim": 64, "layers": 1, "heads": 4,
                "context": task.context, "dropout": 0.0}
    return {}


# -- the sweep -------------------------------------------------------------------------------
def planned(grid: Grid, seeds: list[int]) -> list[tuple[str, int, float | None, float | None, int]]:
    """Every (task, H, lr, momentum, seed); ``None`` lr/momentum: the default.

    Order: the default's runs first (every seed), then the momenta from the highest (the
    published setting), each seed-major, so a sweep cut short still compares whole lr axes.
    """
    out: list[tuple[str, int, float | None, float | None, int]] = [
        (task, h, None, None, seed) for seed in seeds for task in grid.tasks for h in grid.hs]
    for momentum in sorted(grid.momenta, reverse=True):
        for seed in seeds:
            for task in grid.tasks:
                for h in grid.hs:
                    out += [(task, h, lr, momentum, seed) for lr in grid.lrs]
    return out


def run_sweep(grid: Grid, seeds: list[int], runs: Path, corpus: Path) -> None:
    """Run every planned run whose JSON file is missing, writing each as it finishes."""
    runs.mkdir(parents=True, exist_ok=True)
    tasks: dict[str, Any] = {}
    for task, h, lr, momentum, seed in planned(grid, seeds):
        lr_r, m_r = outer_defaults(h) if lr is None else (lr, momentum)
        assert m_r is not None
        path = runs / f"{run_key(task, h, lr_r, m_r, seed)}.json"
        if path.is_file():
            continue
        if task not in tasks:
            tasks[task] = LMTask(grid, corpus) if task == "lm" else CNNTask(grid)
        record = train_one(tasks[task], grid, h, lr, momentum, seed)
        record.update(task=task, h=h, seed=seed, steps=grid.steps,
                      workers=grid.workers_of(task))
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(path)
        print(f"{path.stem}: metric {record['metric']:.4f} ({record['wall_seconds']:.0f} s)",
              flush=True)


def _stats(values: list[float]) -> dict[str, float]:
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values), "n": len(values)}


def _mean(per_seed: dict[int, dict[str, Any]], seeds: list[int]) -> float:
    """The mean metric over ``seeds``; infinite when any is not finite."""
    vals = [per_seed[s]["metric"] for s in seeds]
    return sum(vals) / len(vals) if all(math.isfinite(v) for v in vals) else math.inf


def summarise(grid: Grid, seeds: list[int], runs: Path) -> dict[str, Any]:
    """Per-setting statistics, the best grid setting per (task, H) and the default's verdict.

    A comparison uses the seeds the default has run; a grid setting is a candidate for the
    best only when it has run every one of them (both means are over the same seeds).
    A non-finite metric on any seed makes the setting's mean infinite.
    """
    records = [json.loads(p.read_text()) for p in sorted(runs.glob("*.json"))]
    records = [r for r in records if r["seed"] in seeds and r["steps"] == grid.steps
               and r["workers"] == grid.workers_of(r["task"])]
    out: dict[str, Any] = {"grid": {**grid.__dict__, "seeds": seeds}, "tolerance": TOLERANCE,
                           "settings": [], "verdicts": []}
    for task in grid.tasks:
        for h in grid.hs:
            by: dict[tuple[float, float], dict[int, dict[str, Any]]] = {}
            for r in records:
                if r["task"] == task and r["h"] == h:
                    by.setdefault((r["outer_lr"], r["outer_momentum"]), {})[r["seed"]] = r
            rule = outer_defaults(h)
            for (lr, m), per_seed in sorted(by.items()):
                vals = [per_seed[s]["metric"] for s in sorted(per_seed)]
                row = {"task": task, "h": h, "outer_lr": lr, "outer_momentum": m,
                       "metric": _stats(vals), "seeds": sorted(per_seed), "default": (lr, m) == rule}
                if all("accuracy" in r for r in per_seed.values()):
                    row["accuracy"] = _stats([per_seed[s]["accuracy"] for s in sorted(per_seed)])
                out["settings"].append(row)
            common = sorted(by.get(rule, {}))
            eligible = {k: v for k, v in by.items()
                        if k[0] in grid.lrs and k[1] in grid.momenta and set(common) <= set(v)}
            if not common or not eligible:
                continue
            means = {k: _mean(v, common) for k, v in eligible.items()}
            best = min(means, key=means.__getitem__)
            ratio = _mean(by[rule], common) / means[best]
            out["verdicts"].append({
                "task": task, "h": h, "seeds": common, "compared": len(eligible),
                "best": {"outer_lr": best[0], "outer_momentum": best[1], "metric": means[best]},
                "default": {"outer_lr": rule[0], "outer_momentum": rule[1],
                            "metric": _mean(by[rule], common)},
                "ratio": ratio, "met": ratio <= 1 + TOLERANCE})
    return out


def fit(summary: dict[str, Any], primary: str = "lm") -> list[dict[str, Any]]:
    """Per H, the default the sweep supports: the smallest outer lr within ``TOLERANCE`` of
    the best on every task, or, where no setting is, within it on ``primary``.

    The smallest qualifying lr, because a larger outer step is the riskier side (past the
    best the metric rose steeply with the outer lr, below it gently). The ``primary``
    fallback names the task to trust when the tasks disagree beyond the tolerance. Only
    settings run on every task qualify; means are over each setting's own seeds.

    Returns:
        One row per H: ``{"h", "outer_lr", "outer_momentum", "basis", "ratios"}``, ``basis``
        being ``"all tasks"`` or ``primary``.
    """
    rows = []
    tasks = summary["grid"]["tasks"]
    for h in summary["grid"]["hs"]:
        means: dict[tuple[float, float], dict[str, float]] = {}
        for st in summary["settings"]:
            if st["h"] == h and math.isfinite(st["metric"]["mean"]):
                means.setdefault((st["outer_lr"], st["outer_momentum"]), {})[st["task"]] = st["metric"]["mean"]
        shared = {k: v for k, v in means.items() if set(v) == set(tasks)}
        if not shared:
            continue
        best = {t: min(v[t] for v in means.values() if t in v) for t in tasks}
        ratios = {k: {t: v[t] / best[t] for t in tasks} for k, v in shared.items()}
        for basis, names in (("all tasks", tasks), (primary, [primary])):
            ok = [k for k, r in ratios.items() if all(r[t] <= 1 + TOLERANCE for t in names)]
            if ok:
                pick = min(ok, key=lambda k: (k[0], -k[1]))
                rows.append({"h": h, "outer_lr": pick[0], "outer_momentum": pick[1],
                             "basis": basis, "ratios": ratios[pick]})
                break
    return rows


def markdown(summary: dict[str, Any]) -> str:
    """The summary as Markdown tables: metric per lr x momentum for each (task, H)."""
    g = summary["grid"]
    lines = [f"Outer lr x momentum x H: {g['lm_workers']} (lm) and {g['workers']} (cnn) simulated "
             f"workers, {g['steps']} inner "
             f"steps per run, seeds {g['seeds']}; metric: lm validation perplexity, cnn test "
             f"cross-entropy (mean over seeds, [min, max], (number of seeds), and the cnn's test accuracy); `*`: the "
             f"default rule's setting.", ""]
    for task in g["tasks"]:
        for h in g["hs"]:
            rows = [s for s in summary["settings"] if s["task"] == task and s["h"] == h]
            if not rows:
                continue
            momenta = sorted({s["outer_momentum"] for s in rows})
            lrs = sorted({s["outer_lr"] for s in rows})
            lines += [f"### {task}, H = {h}", "",
                      "| outer lr | " + " | ".join(f"momentum {m:g}" for m in momenta) + " |",
                      "|---:|" + "---:|" * len(momenta)]
            for lr in lrs:
                cells = []
                for m in momenta:
                    s = next((s for s in rows if s["outer_lr"] == lr and s["outer_momentum"] == m), None)
                    if s is None:
                        cells.append("")
                        continue
                    st = s["metric"]
                    acc = (f", acc {100 * s['accuracy']['mean']:.1f}%" if "accuracy" in s else "")
                    cells.append(f"{'*' if s['default'] else ''}{st['mean']:.4g} "
                                 f"[{st['min']:.4g}, {st['max']:.4g}] ({st['n']}){acc}")
                lines.append(f"| {lr:g} | " + " | ".join(cells) + " |")
            lines.append("")
    lines += ["| task | H | seeds | settings compared | best (lr, momentum) | best | default (lr, "
              "momentum) | default | ratio | within 5% |", "|---|---:|---|---:|---|---:|---|---:|---:|---|"]
    for v in summary["verdicts"]:
        b, d = v["best"], v["default"]
        lines.append(f"| {v['task']} | {v['h']} | {v['seeds']} | {v['compared']} | "
                     f"({b['outer_lr']:g}, {b['outer_momentum']:g}) | "
                     f"{b['metric']:.4g} | ({d['outer_lr']:g}, {d['outer_momentum']:g}) | "
                     f"{d['metric']:.4g} | {v['ratio']:.3f} | {'yes' if v['met'] else 'NO'} |")
    if summary.get("fit"):
        lines += ["", "Fit (per H, the smallest outer lr within 5% of the best on every task, "
                  "else on the language model; settings run on every task):", "",
                  "| H | outer lr | momentum | within 5% on | ratios to each task's best |",
                  "|---:|---:|---:|---|---|"]
        for f in summary["fit"]:
            ratios = ", ".join(f"{t} {r:.3f}" for t, r in f["ratios"].items())
            lines.append(f"| {f['h']} | {f['outer_lr']:g} | {f['outer_momentum']:g} | "
                         f"{f['basis']} | {ratios} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command line: run (resumably) and summarise."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=Path, required=True, help="directory of per-run JSON files")
    p.add_argument("--summary", type=Path, default=HERE / "results" / "outer_sweep",
                   help="summary path without suffix (.json and .md are written)")
    p.add_argument("--corpus", type=Path, default=CORPUS,
                   help="directory with WikiText-2's test.txt and valid.txt (the lm task)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--tasks", nargs="+", default=list(Grid.tasks), choices=["lm", "cnn"])
    p.add_argument("--hs", type=int, nargs="+", default=list(Grid.hs))
    p.add_argument("--lrs", type=float, nargs="+", default=list(Grid.lrs))
    p.add_argument("--momenta", type=float, nargs="+", default=list(Grid.momenta))
    p.add_argument("--steps", type=int, default=Grid.steps)
    p.add_argument("--workers", type=int, default=Grid.workers, help="workers of the cnn task")
    p.add_argument("--lm-workers", type=int, default=Grid.lm_workers, help="workers of the lm task")
    p.add_argument("--lm-chars", type=int, default=Grid.lm_chars)
    p.add_argument("--collect-only", action="store_true", help="summarise the runs found")
    args = p.parse_args(argv)
    for name in ("steps", "workers", "lm_workers", "lm_chars"):
        if getattr(args, name) < 1:
            p.error(f"`--{name.replace('_', '-')}` must be >= 1, got {getattr(args, name)}")
    bad = [h for h in args.hs if h < 1 or args.steps % h]
    if bad:
        p.error(f"`--hs` must divide `--steps` ({args.steps}) so every run ends on a "
                f"synchronisation, got {bad}")
    for name, values, high in (("lrs", args.lrs, math.inf), ("momenta", args.momenta, 1.0)):
        bad_values = [v for v in values if not 0 < v < high]
        if bad_values:
            p.error(f"`--{name}` must be in (0, {high:g}), got {bad_values}")
    grid = Grid(tuple(args.tasks), tuple(args.hs), tuple(args.lrs), tuple(args.momenta),
                args.steps, args.workers, args.lm_workers, lm_chars=args.lm_chars)
    torch.set_num_threads(1)
    if not args.collect_only:
        run_sweep(grid, args.seeds, args.runs, args.corpus)
    summary = summarise(grid, args.seeds, args.runs)
    summary["fit"] = fit(summary)
    args.summary.parent.mkdir(parents=True, exist_ok=True)
    args.summary.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    args.summary.with_suffix(".md").write_text(markdown(summary))
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
