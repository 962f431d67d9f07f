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
``summary.json``), prints a table and draws ``claims.png`` beside it (the metric against the
bytes sent, one panel per setting).
The settings and the plan of the grid are in ``_claims_plan.py`` beside this file; which runs
are finished, the archive and the rows in ``_claims_results.py``; the plot in ``_claims_plot.py``.

Usage::

    python -m benchmarks.claims --settings smoke --parallel 2            # seconds, on CPU
    python -m benchmarks.claims --settings cifar10-resnet8 --device cuda --parallel 8 \\
        --cifar-data .devdata/cifar10-jpeg.tar.gz --seeds 0 --deadline 450 --pack out.tar.gz
    python -m benchmarks.claims --settings cifar10-resnet8,wikitext2-lstm --collect
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gradzip.train.metrics import read_summary
from gradzip.train.runner import RunConfig, resolve_config, run

# ROLES and the schedule helpers, unused here, are imported too: the script's users read
# them as claims.ROLES etc.
from ._claims_plan import (  # noqa: F401
    ROLES,
    SETTINGS,
    Planned,
    Setting,
    critical_ranges,
    plan,
    schedule_text,
    select,
)
from ._claims_plot import plot
from ._claims_results import collect, finished, pack, table, unpack
from ._common import RESULTS, module_command, package_env
from ._overrides import parse_sets

#: Seconds kept free before the deadline to end the runs in flight and write the archive.
MARGIN_S = 20.0


# -- running ----------------------------------------------------------------------------------
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
    return subprocess.Popen([*module_command("claims"), "--one", json.dumps(cfg.to_dict())],
                            stdout=log, stderr=subprocess.STDOUT, env=package_env(env))


def execute(runs: list[Planned], parallel: int, deadline: float | None,
            archive: Path | None, root: Path, estimate_s: float | None = None,
            margin_s: float = MARGIN_S, clock: Callable[[], float] = time.monotonic
            ) -> dict[str, int]:
    """Run what is not finished, ``parallel`` at a time, within ``deadline`` (a time of
    ``clock``, or None). A run is launched only when it is expected to end before the deadline:
    expected to take as long as the slowest finished run of its setting, or ``estimate_s``
    before one finished (``None``: launch). Runs still going shortly before the deadline are
    ended, their folders renamed ``*.stopped``. Returns counts: ``done``, ``skipped``, ``failed``,
    ``stopped``, ``left`` (not launched). ``clock`` (seconds, never decreasing; default
    ``time.monotonic``) is read once per pass of the polling loop, for the deadline and for
    the runs' durations."""
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
        now = clock()
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
            took = clock() - start
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
        link, want = dest / name, (found[0].parent / target).resolve()
        # A run folder copied from another checkout keeps links to that checkout's files,
        # which may be gone (``exists()`` is then False but the name is taken): re-point them.
        if link.is_symlink() and link.resolve() != want:
            link.unlink()
        if not link.exists():
            link.symlink_to(want)
    return dest


def data_options(setting: Setting, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """The ``data`` (and cache) options of the setting's runs, from ``args.cifar_data`` and
    ``args.text_data``: the decoded CIFAR-10 cache under ``root / "cache"``, WikiText-2's
    training layout under ``root / "data"``. Also used by ``sparse_layers.py``."""
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
    p.add_argument("--results", default=str(RESULTS), help="where claims.json goes")
    p.add_argument("--dry-run", action="store_true", help="list the runs and their status")
    p.add_argument("--check", action="store_true", help="print what this machine offers; run nothing")
    args = p.parse_args(argv)
    if args.check:
        check()
        return 0
    if args.one is not None:
        # An interrupted run continues (a plain re-run over its results is refused).
        run(resolve_config(RunConfig.from_dict(json.loads(args.one))), resume=True)
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
        # Collecting and listing read finished runs only: no data needed.
        data = {} if args.collect or args.dry_run else data_options(setting, args, root)
        options = {**data, "device": args.device,
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
        if plot(rows, results / "claims.png"):
            print(f"wrote {results / 'claims.png'}")
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
