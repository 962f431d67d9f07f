"""The papers' claims as a grid of runs: levels, Accordion, the critical-regime ablation, and the
hard threshold against Top-k, per setting, family and seed (BENCHMARKS.md section 4).

A *setting* fixes task, model, data size, epochs and learning-rate schedule; each *family*
(PowerSGD, Top-k) gives a level pair (aggressive, gentle). Per setting, family and seed the
grid holds one run per *role*:

* ``none``: dense exchange (one per setting and seed, family ``dense``);
* ``gentle`` / ``aggressive``: one level throughout;
* ``accordion``: Accordion between them (``eta`` and interval of the setting);
* ``critical-gentle``: the gentle level only in the critical regimes (the first K epochs and K'
  epochs after each learning-rate drop), aggressive elsewhere; ``critical-aggressive``: the
  reverse (a level schedule each);
* ``topk`` / ``threshold``: Top-k and the hard threshold (``budget`` = the same density) at the
  setting's densities (family ``sparse``), for the bytes-vs-quality curves.

Each run is the runner's (:func:`gradzip.train.runner.run`) in its own process with one thread,
``--parallel`` at a time; a run whose ``summary.json`` holds the same configuration is skipped, so
an interrupted grid resumes. ``--deadline`` stops launching runs that would not finish in time
(estimated from the runs already finished) and ends the ones still running shortly before it,
keeping their partial files aside (``seedN.stopped``; a later call starts them afresh). ``--pack`` keeps an archive of every finished run's
``summary.json``, ``metrics.jsonl`` and ``accordion_decisions.json``, rewritten after each run.
``--collect`` writes ``benchmarks/results/claims.json`` (one row per finished run, from its own
``summary.json``) and prints a table.

Usage::

    python benchmarks/claims.py --settings smoke --parallel 2            # seconds, on CPU
    python benchmarks/claims.py --settings cifar10-resnet8 --device cuda --parallel 8 \\
        --cifar-data .devdata/cifar10-jpeg.tar.gz --seeds 0 --deadline 450 --pack out.tar.gz
    python benchmarks/claims.py --settings cifar10-resnet8,wikitext2-lstm --collect
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# The package of the checkout this script belongs to (installed or not, e.g. on a machine
# that only has a copy of the repository), ahead of any other installed copy.
sys.path.insert(0, str(HERE.parent / "src"))
if str(HERE) not in sys.path:  # the shared helpers sit beside this file (also when imported)
    sys.path.append(str(HERE))

from _overrides import parse_sets  # noqa: E402

from gradzip.train.metrics import read_summary  # noqa: E402
from gradzip.train.runner import RunConfig, resolve_config, run  # noqa: E402

ROLES = ("none", "gentle", "aggressive", "accordion", "critical-gentle", "critical-aggressive",
         "topk", "threshold")
PACKED = ("summary.json", "metrics.jsonl", "accordion_decisions.json")
#: Seconds kept free before the deadline to end the runs in flight and write the archive.
MARGIN_S = 20.0


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
    # Word-level 2-layer LSTM, trained on WikiText-2's test.txt, evaluated on valid.txt;
    # critical regimes: epochs 0-2, 12-14, 18-20.
    Setting("wikitext2-lstm", {"task": "lm", "workers": 4, "epochs": 24, "batch_size": 20,
                               "lr": 1.25, "momentum": 0.0, "warmup_epochs": 2,
                               "milestones": [0.5, 0.75], "interval_epochs": 2.0, "clip": 0.25,
                               "eta": 0.5},
            {"topk": ("topk:ratio=0.02", "topk:ratio=0.99")}, (2.0, 2.0), (0.003, 0.01, 0.03),
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


# -- running ----------------------------------------------------------------------------------
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


def _stopped(out: Path) -> Path:
    """Where a run ended by the deadline keeps its partial files."""
    return out.with_name(out.name + ".stopped")


def _launch(cfg: RunConfig) -> subprocess.Popen[bytes]:
    """One run in its own process, one thread (its output goes to ``OUT.log`` beside it)."""
    out = Path(cfg.out)
    for stale in (out, _stopped(out)):  # an earlier, interrupted attempt: start clean
        if stale.exists():
            shutil.rmtree(stale)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    log = (out.parent / f"{out.name}.log").open("wb")
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--one",
                             json.dumps(cfg.to_dict())], stdout=log, stderr=subprocess.STDOUT,
                            env=env)


def execute(runs: list[Planned], parallel: int, deadline: float | None,
            archive: Path | None, root: Path, estimate_s: float | None = None,
            margin_s: float = MARGIN_S) -> dict[str, int]:
    """Run what is not finished, ``parallel`` at a time, within ``deadline`` (a monotonic
    time, or None). A run is launched only when it is expected to end before the deadline:
    expected to take as long as the slowest finished run of its setting, or ``estimate_s``
    before one finished (``None``: launch). Runs still going shortly before the deadline are
    ended, their folders renamed ``*.stopped``. Returns counts: ``done``, ``skipped``, ``failed``,
    ``stopped``, ``left`` (not launched)."""
    todo = [r for r in runs if finished(r.config) is None]
    counts = {"skipped": len(runs) - len(todo), "done": 0, "failed": 0, "stopped": 0, "left": 0}
    seconds: dict[str, list[float]] = {}
    active: dict[subprocess.Popen[bytes], tuple[Planned, float]] = {}
    for r in todo:
        resolve_config(r.config)  # configuration errors before any process starts

    def estimate(r: Planned) -> float:
        seen = seconds.get(r.setting)
        return max(seen) if seen else (estimate_s or 0.0)

    while todo or active:
        now = time.monotonic()
        while todo and len(active) < parallel:
            r = todo[0]
            if deadline is not None and now + estimate(r) > deadline - margin_s:
                break
            todo.pop(0)
            active[_launch(r.config)] = (r, now)
            print(f"start {r.config.out}", file=sys.stderr, flush=True)
        if not active:
            break  # nothing fits before the deadline
        if deadline is not None and now > deadline - margin_s:
            for proc, (r, _) in active.items():
                proc.terminate()
                proc.wait(30)
                # Kept aside, not resumed: its epochs so far still show in the archive.
                out = Path(r.config.out)
                if out.exists():
                    out.rename(_stopped(out))
                counts["stopped"] += 1
                print(f"stopped {r.config.out} (deadline)", file=sys.stderr, flush=True)
            active.clear()
            if archive is not None:
                pack(root, archive)
            break
        time.sleep(0.2)
        for proc in [p for p in active if p.poll() is not None]:
            r, start = active.pop(proc)
            took = time.monotonic() - start
            ok = proc.returncode == 0 and read_summary(r.config.out) is not None
            counts["done" if ok else "failed"] += 1
            if ok:
                seconds.setdefault(r.setting, []).append(took)
            print(f"{'done' if ok else 'FAILED'} {r.config.out} in {took:.0f} s",
                  file=sys.stderr, flush=True)
            if archive is not None:
                pack(root, archive)
    counts["left"] = len(todo)
    return counts


# -- collecting -------------------------------------------------------------------------------
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
            final = 100.0 * final
        rows.append({"setting": r.setting, "family": r.family, "role": r.role, "spec": r.spec,
                     "seed": r.seed, "metric": metric, "final": final,
                     "wire_bytes_per_worker": summary["bytes_sent_per_worker"]})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Mean final metric and bytes over seeds, per setting, family and spec."""
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["setting"], row["family"], row["role"], row["spec"]), []).append(row)
    lines = [f"{'setting':<20} {'family':<9} {'role':<20} {'seeds':>5} {'final':>8} {'spread':>7} "
             f"{'MB/worker':>10}  spec"]
    for (setting, family, role, spec), items in groups.items():
        finals = [i["final"] for i in items if i["final"] is not None]
        mean = sum(finals) / len(finals) if finals else float("nan")
        spread = max(finals) - min(finals) if finals else float("nan")
        mb = sum(i["wire_bytes_per_worker"] for i in items) / len(items) / 1e6
        lines.append(f"{setting:<20} {family:<9} {role:<20} {len(items):>5} {mean:>8.2f} "
                     f"{spread:>7.2f} {mb:>10.1f}  {spec}")
    return "\n".join(lines)


# -- data -------------------------------------------------------------------------------------
def text_dir(archive: Path, work: Path) -> Path:
    """WikiText-2 (partial) as the runner's text layout: ``train.txt`` -> ``test.txt`` and
    ``valid.txt``, unpacked once under ``work``. A directory holding ``test.txt`` works too."""
    source = archive.expanduser()
    if source.is_file():
        unpacked = work / "wikitext-2-unpacked"
        if not unpacked.is_dir():
            with tarfile.open(source, "r:*") as tar:
                tar.extractall(unpacked, filter="data")
        source = unpacked
    found = sorted(source.rglob("test.txt"))
    if not found or not (found[0].parent / "valid.txt").is_file():
        raise ValueError(f"`text_data` must hold test.txt and valid.txt, got {str(archive)!r}")
    dest = work / "wikitext-2-train-on-test"
    dest.mkdir(parents=True, exist_ok=True)
    for name, target in (("train.txt", "test.txt"), ("valid.txt", "valid.txt")):
        link = dest / name
        if not link.exists():
            link.symlink_to((found[0].parent / target).resolve())
    return dest


def data_options(setting: Setting, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """The ``data`` (and cache) options of the setting's runs (none needed to collect)."""
    if args.collect or args.dry_run:
        return {}
    if setting.data == "cifar":
        if args.cifar_data is None:
            raise SystemExit(f"setting {setting.name} needs --cifar-data")
        return {"data": str(Path(args.cifar_data).expanduser().resolve()),
                "cache_dir": str((root / "cache").resolve())}
    if setting.data == "text":
        if args.text_data is None:
            raise SystemExit(f"setting {setting.name} needs --text-data")
        return {"data": str(text_dir(Path(args.text_data), root / "data").resolve())}
    return {}


def prepare_cifar(path: str, cache_dir: Path) -> None:
    """Decode the CIFAR archive once, here, into the runner's cache, so that parallel runs
    only read it. Without Pillow, JPEG files are decoded with torchvision instead."""
    from gradzip.train import cifar

    try:
        cifar.load_cifar10(path, cache_dir=cache_dir)
        return
    except ImportError:
        pass
    try:
        import numpy as np
        import torch
        from torchvision.io import decode_jpeg
    except ImportError:
        raise SystemExit("decoding the CIFAR JPEG files needs Pillow or torchvision") from None

    def decode(data: bytes, name: str) -> Any:
        image = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return np.ascontiguousarray(image.permute(1, 2, 0).numpy())

    cifar._decode_image = decode  # this process only: it writes the cache the runs read
    cifar.load_cifar10(path, cache_dir=cache_dir)


def check() -> None:
    """Print what the runs need on this machine."""
    import importlib
    import platform

    import torch

    print(f"python {platform.python_version()}, torch {torch.__version__}, "
          f"cuda available {torch.cuda.is_available()}, cpus {os.cpu_count()}")
    if torch.cuda.is_available():
        print(f"gpu {torch.cuda.get_device_name(0)}")
    for name in ("numpy", "PIL", "torchvision", "matplotlib"):
        try:
            module = importlib.import_module(name)
            print(f"{name} {getattr(module, '__version__', '?')}")
        except ImportError:
            print(f"{name} missing")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one configuration (JSON)
    p.add_argument("--settings", default="smoke", help=f"comma-separated, of {', '.join(SETTINGS)}")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--only", action="append", default=[], metavar="ROLE/FAMILY",
                   help="keep runs of ROLE (and FAMILY): accordion, gentle/powersgd, /topk; repeatable")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a runner option of every run, e.g. --set epochs=2")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--parallel", type=int, default=2, help="runs at a time (default 2)")
    p.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                   help="launch no run that would not finish within SECONDS from now; end the "
                        "ones in flight shortly before it")
    p.add_argument("--estimate", type=float, default=None, metavar="SECONDS",
                   help="expected seconds of one run before any finished (for --deadline; "
                        "default: launch until one finished, then use the slowest)")
    p.add_argument("--root", default="runs/claims", help="run folders (default runs/claims)")
    p.add_argument("--cifar-data", default=None, help="CIFAR-10 archive or tree")
    p.add_argument("--text-data", default=None, help="wikitext-2-partial archive or folder")
    p.add_argument("--pack", default=None, metavar="FILE.tar.gz",
                   help="archive of the finished runs' files, refreshed after each run")
    p.add_argument("--resume-from", default=None, metavar="FILE.tar.gz",
                   help="restore the finished runs of an earlier --pack archive first (they are "
                        "skipped), e.g. to continue a grid on a fresh machine")
    p.add_argument("--collect", action="store_true",
                   help="write benchmarks/results/claims.json from the finished runs; run nothing")
    p.add_argument("--results", default=str(HERE / "results"), help="where claims.json goes")
    p.add_argument("--dry-run", action="store_true", help="list the runs and their status")
    p.add_argument("--check", action="store_true", help="print what this machine offers; run nothing")
    args = p.parse_args(argv)
    if args.check:
        check()
        return 0
    if args.one is not None:
        run(resolve_config(RunConfig.from_dict(json.loads(args.one))))
        return 0
    start = time.monotonic()
    names = [n for n in args.settings.split(",") if n]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        raise SystemExit(f"--settings must be among {', '.join(SETTINGS)}, got {unknown}")
    if args.parallel < 1:
        raise SystemExit(f"--parallel must be >= 1, got {args.parallel}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    root = Path(args.root)
    if args.resume_from:
        restored = unpack(Path(args.resume_from), root)
        print(f"restored {restored} finished runs from {args.resume_from}", file=sys.stderr)
    runs: list[Planned] = []
    for name in names:
        setting = SETTINGS[name]
        options = {**data_options(setting, args, root), "device": args.device,
                   **parse_sets(args.set)}
        runs += plan(setting, seeds, root, options)
    runs = select(runs, args.only)
    if args.collect or args.dry_run:
        rows = collect(runs)
        if args.dry_run:
            done = {(r["setting"], r["family"], r["role"], r["spec"], r["seed"]) for r in rows}
            for r in runs:
                key = (r.setting, r.family, r.role, r.spec, r.seed)
                print(f"{'done' if key in done else 'todo'}  {r.config.out}")
            return 0
        results = Path(args.results)
        results.mkdir(parents=True, exist_ok=True)
        (results / "claims.json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
        print(table(rows))
        print(f"wrote {results / 'claims.json'} ({len(rows)} rows)")
        return 0
    if any(SETTINGS[n].data == "cifar" for n in names):
        prepare_cifar(str(Path(args.cifar_data).expanduser().resolve()), root / "cache")
    deadline = None if args.deadline is None else start + args.deadline
    counts = execute(runs, args.parallel, deadline, Path(args.pack) if args.pack else None,
                     root, args.estimate)
    if args.pack:
        packed = pack(root, Path(args.pack))
        print(f"packed {packed} runs into {args.pack}", file=sys.stderr)
    print(json.dumps(counts), file=sys.stderr)
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
