"""The claims grid (``claims.py``): its settings, the runs planned per setting, family, role and
seed, and the critical-regime level schedules. ``claims.py`` imports it from beside itself,
after putting the checkout's ``src`` on ``sys.path``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from gradzip.train.idle import idle_options
from gradzip.train.runner import RunConfig

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunConfig)}

ROLES = ("none", "gentle", "aggressive", "accordion", "critical-gentle", "critical-aggressive",
         "topk", "threshold")


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting: the runner options shared by its runs, its level pairs and its regimes.

    Attributes:
        name: the folder and the ``setting`` of the rows.
        base: runner options (``gradzip train`` names) of every run; ``data`` is filled from
            ``--cifar-data``/``--text-data`` by ``data``.
        families: family -> ``(aggressive, gentle)`` specs.
        critical: ``(K, K')``: epochs of the first critical regime and after each LR drop.
        densities: Top-k ratios (and threshold budgets) of the curves.
        data: ``"cifar"``, ``"text"`` or ``None`` (the task needs no file).
    """

    name: str
    base: dict[str, Any]
    families: dict[str, tuple[str, str]]
    critical: tuple[float, float]
    densities: tuple[float, ...]
    data: str | None = None


_CIFAR = {"task": "cifar10", "workers": 4, "momentum": 0.9, "weight_decay": 1e-4, "eta": 0.5,
          "milestones": [0.5, 0.75], "lr": 0.1}
SETTINGS = {s.name: s for s in (
    # Seconds-long, for CI: embedded digits, 2 workers.
    Setting("smoke", {"task": "digits", "workers": 2, "epochs": 4, "limit_train": 256,
                      "batch_size": 16, "milestones": [0.5], "interval_epochs": 1.0},
            {"powersgd": ("powersgd:rank=1", "powersgd:rank=2")}, (1.0, 1.0), (0.05,)),
    # All 50,000 CIFAR-10 images, ResNet-8 (width 16), batch 4 x 128 as in the paper, 16
    # epochs, LR /10 at 50% and 75%; decisions every 2 epochs, each over the last epoch;
    # critical regimes: epochs 0-2, 8-10, 12-14.
    Setting("cifar10-resnet8", {**_CIFAR, "model": "resnet8:width=16", "batch_size": 128,
                                "epochs": 16, "warmup_epochs": 2, "interval_epochs": 2.0},
            {"powersgd": ("powersgd:rank=1", "powersgd:rank=4"),
             "topk": ("topk:ratio=0.1", "topk:ratio=0.99")},
            (2.0, 2.0), (0.003, 0.01, 0.03), data="cifar"),
    # The same, twice as wide (4x the parameters): more room between the levels.
    Setting("cifar10-resnet8w32", {**_CIFAR, "model": "resnet8:width=32", "batch_size": 128,
                                   "epochs": 16, "warmup_epochs": 2, "interval_epochs": 2.0},
            {"powersgd": ("powersgd:rank=1", "powersgd:rank=4"),
             "topk": ("topk:ratio=0.1", "topk:ratio=0.99")},
            (2.0, 2.0), (0.003, 0.01, 0.03), data="cifar"),
    # Word-level 2-layer LSTM (about 6.3M parameters, most in the embedding and decoder),
    # trained on WikiText-2's test.txt, evaluated on valid.txt; 10 epochs (about 19 minutes
    # on one core: an epoch is about 90 s of training and 22 s of evaluation), LR 5 x 4
    # workers (20, with the gradient clipped at 0.25, as PyTorch's word-language-model
    # example; 1.25 and 0.3125 x 4 learned more slowly: validation perplexity 821
    # and 688 after 3 epochs against 521), /10 at epochs 5 and 7.5; decisions every epoch;
    # critical regimes: epochs 0-1, 5-6, 7.5-8.5.
    Setting("wikitext2-lstm", {"task": "lm", "workers": 4, "epochs": 10, "batch_size": 20,
                               "lr": 5.0, "momentum": 0.0, "warmup_epochs": 1,
                               "milestones": [0.5, 0.75], "interval_epochs": 1.0, "clip": 0.25,
                               "eta": 0.5},
            {"topk": ("topk:ratio=0.02", "topk:ratio=0.99")}, (1.0, 1.0), (0.003, 0.01, 0.03),
            data="text"),
)}


@dataclasses.dataclass(frozen=True)
class Planned:
    """One run of the grid: its row keys and configuration."""

    setting: str
    family: str
    role: str
    spec: str
    seed: int
    config: RunConfig


def critical_ranges(setting: Setting, epochs: int, milestones: list[float]) -> list[tuple[float, float]]:
    """The critical regimes in epochs: ``[0, K)`` and ``[m, m + K')`` for each LR drop ``m``."""
    first, after = setting.critical
    drops = [m * epochs if m < 1 else m for m in milestones]
    ranges = [(0.0, min(first, epochs))] + [(m, min(m + after, epochs)) for m in drops]
    merged: list[tuple[float, float]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return merged


def schedule_text(ranges: list[tuple[float, float]], epochs: int, gentle_inside: bool) -> str:
    """``--level-schedule`` text: gentle inside ``ranges`` (or outside, when not
    ``gentle_inside``)."""
    inside, outside = ("gentle", "aggressive") if gentle_inside else ("aggressive", "gentle")
    parts, at = [], 0.0
    for a, b in ranges:
        if a > at:
            parts.append(f"{outside}:{at:g}-{a:g}")
        parts.append(f"{inside}:{a:g}-{b:g}")
        at = b
    if at < epochs:
        parts.append(f"{outside}:{at:g}-{epochs:g}")
    return ",".join(parts)


def plan(setting: Setting, seeds: list[int], root: Path, options: dict[str, Any]) -> list[Planned]:
    """Every run of ``setting`` for ``seeds``; ``options`` override the setting's base."""
    base = {**setting.base, **options}
    epochs = int(base["epochs"])
    ranges = critical_ranges(setting, epochs, list(base.get("milestones") or []))
    runs: list[Planned] = []

    def add(family: str, role: str, spec: str, label: str, seed: int, **fields: Any) -> None:
        out = root / setting.name / family / label / f"seed{seed}"
        cfg = RunConfig.from_dict({**base, **fields, "seed": seed, "out": str(out), "threads": 1})
        # The setting's shared options apply where they act (interval_epochs and eta to the
        # Accordion runs, not to the static ones beside them), as in `gradzip compare`.
        cfg = dataclasses.replace(cfg, **{n: _DEFAULTS[n] for n in idle_options(cfg)
                                          if n in base and n not in fields})
        runs.append(Planned(setting.name, family, role, spec, seed, cfg))

    for seed in seeds:
        add("dense", "none", "none", "none", seed, compressor="none")
        for family, (aggressive, gentle) in setting.families.items():
            add(family, "gentle", gentle, "gentle", seed, compressor=gentle)
            add(family, "aggressive", aggressive, "aggressive", seed, compressor=aggressive)
            add(family, "accordion", f"{aggressive}<->{gentle}", "accordion", seed,
                compressor=aggressive, accordion=gentle)
            for role, inside in (("critical-gentle", True), ("critical-aggressive", False)):
                text = schedule_text(ranges, epochs, inside)
                add(family, role, f"{aggressive}<->{gentle} [{text}]", role, seed,
                    compressor=aggressive, gentle=gentle, level_schedule=text)
        for density in setting.densities:
            topk, threshold = f"topk:ratio={density:g}", f"threshold:budget={density:g}"
            add("sparse", "topk", topk, f"topk-{density:g}", seed, compressor=topk)
            add("sparse", "threshold", threshold, f"threshold-{density:g}", seed,
                compressor=threshold)
    return runs


def select(runs: list[Planned], only: list[str]) -> list[Planned]:
    """Keep runs matching any ``ROLE``, ``ROLE/FAMILY`` or ``/FAMILY`` filter (all when none)."""
    def match(r: Planned, f: str) -> bool:
        role, _, family = f.partition("/")
        return (not role or role == r.role) and (not family or family == r.family)
    return [r for r in runs if not only or any(match(r, f) for f in only)]
