"""The engine's host time per step, against the code of another revision in the same process.

    python -m benchmarks.engine_ab --before REV [--out DIR] [--rounds R] [--steps N]
                                   [--width W] [--buckets B] [--only SCHEME ...]

``host_time.py`` compares schemes with native DDP within one revision. A change to the engine
is judged against the code before it, and on this machine two runs of ``host_time.py`` differ
by 15-40%, more than most such changes. So both revisions run in one process: the package
``gradzip`` of revision ``REV`` is extracted (``git archive``) into a temporary directory as
the package ``gradzip_before`` (its imports of itself rewritten), and each scheme is built
once with each revision and trained side by side: in each of ``--rounds`` rounds every
(scheme, revision) runs ``--steps`` steps, in an order rotated from round to round.

Timed: the seconds spent inside ``Engine.reduce_bucket`` per step (what the hook does for a
step, DDP's own bucketing aside), on the decision path and forms of ops a GPU takes (as
``host_time.py``'s ``device`` path). Reported per scheme: the minimum and the median over
rounds of each block's mean, and the ratio of the minimums, now over before (the least
disturbed blocks: a median moves with the machine's load). Both revisions start from the
same weights and inputs, so ``same_bits`` tells whether their parameters after the last
step are equal bit for bit (a change that claims the same results must show ``true``).

Results: ``engine_ab.json`` and ``engine_ab.md`` in ``--out`` (default
``benchmarks/results/``). The machine must be quiet.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import io
import json
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from benchmarks import host_time, op_counts

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
#: The package name the other revision is loaded under.
BEFORE = "gradzip_before"
#: Schemes timed by default: every gradzip scheme of ``host_time.py`` (``gradzip:SPEC`` per
#: bucket, ``gradzip-fused:SPEC`` with the step's buckets in one call).
SCHEMES = [s for s in host_time.SCHEMES if s.startswith(("gradzip:", "gradzip-fused:"))]
#: ``gradzip`` as a whole word in imports and dotted names (not ``gradzip_x`` or ``xgradzip``).
_SELF = re.compile(r"\bgradzip(?=[.\s,;:)\"']|$)", re.MULTILINE)


def extract(rev: str, into: Path, repo: Path = ROOT) -> Path:
    """``src/gradzip`` of ``rev`` written under ``into`` as the package :data:`BEFORE`, its
    references to itself renamed; returns the directory that holds it (for :func:`load`).

    Raises:
        ValueError: ``rev`` is not a revision of ``repo`` holding ``src/gradzip``.
    """
    try:
        data = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", rev,
                               "src/gradzip"], check=True, capture_output=True).stdout
    except subprocess.CalledProcessError as exc:
        raise ValueError(f"`rev` must name a revision with src/gradzip, got {rev!r}: "
                         f"{exc.stderr.decode().strip()}") from exc
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    package = into / BEFORE
    (into / "src" / "gradzip").rename(package)
    for path in package.rglob("*.py"):
        path.write_text(_SELF.sub(BEFORE, path.read_text()))
    return into


def load(root: Path) -> Any:
    """Import the package :data:`BEFORE` that :func:`extract` wrote under ``root``, without
    touching ``sys.path`` (its submodules are found through the package's own path)."""
    for name in [m for m in sys.modules if m == BEFORE or m.startswith(BEFORE + ".")]:
        del sys.modules[name]  # a revision loaded before in this process
    package = root / BEFORE
    spec = importlib.util.spec_from_file_location(
        BEFORE, package / "__init__.py", submodule_search_locations=[str(package)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[BEFORE] = module
    spec.loader.exec_module(module)
    importlib.import_module(BEFORE + ".ddp")
    return module


class Side:
    """One scheme built with one revision's package, ready to take timed steps."""

    def __init__(self, package: Any, scheme: str, model_fn: Callable[[], torch.nn.Module],
                 inputs: torch.Tensor, cap_mb: float) -> None:
        kind, spec = scheme.split(":", 1)
        torch.manual_seed(0)
        self.model = model_fn()
        self.ddp = DistributedDataParallel(self.model, bucket_cap_mb=cap_mb)
        hook = package.ddp.register(self.ddp, spec, overlap=False,
                                    fuse_buckets=kind == "gradzip-fused")
        op_counts.force_device_path(hook)
        self.forms = importlib.import_module(package.__name__ + ".ops.branches").device_forms
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.inputs = inputs

    def block(self, steps: int, clock: list[float]) -> float:
        """Engine seconds per step over ``steps`` steps (``clock``: the shared accumulator
        the timed ``reduce_bucket`` adds to)."""
        with self.forms():
            clock[0] = 0.0
            for _ in range(steps):
                self.opt.zero_grad(set_to_none=False)
                self.ddp(self.inputs).float().pow(2).mean().backward()
                self.opt.step()
            return clock[0] / steps

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def _timed(package: Any, clock: list[float]) -> Callable[[], None]:
    """Make ``package``'s ``Engine.reduce_bucket`` add its wall time to ``clock[0]``; returns
    the function that puts the original back."""
    core = importlib.import_module(package.__name__ + ".engine.core")
    inner = core.Engine.reduce_bucket

    def reduce_bucket(self: Any, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        try:
            inner(self, *args, **kwargs)
        finally:
            clock[0] += time.perf_counter() - start

    core.Engine.reduce_bucket = reduce_bucket

    def restore() -> None:
        core.Engine.reduce_bucket = inner

    return restore


def measure(before: Any, now: Any, schemes: list[str], *, width: int, buckets: int,
            rounds: int, steps: int, warmup: int) -> list[dict[str, Any]]:
    """One row per scheme: both revisions' engine seconds per step and whether they agree."""
    op_counts._init_group()
    torch.set_num_threads(1)
    clock = [0.0]
    restores = [_timed(package, clock) for package in (before, now)]
    try:
        return _measure(before, now, schemes, clock, width=width, buckets=buckets,
                        rounds=rounds, steps=steps, warmup=warmup)
    finally:
        for restore in restores:
            restore()


def _measure(before: Any, now: Any, schemes: list[str], clock: list[float], *, width: int,
             buckets: int, rounds: int, steps: int, warmup: int) -> list[dict[str, Any]]:
    model_fn = host_time._model_fn(width)
    torch.manual_seed(0)
    inputs = torch.randn(2, 3, 32, 32)
    cap = op_counts._bucket_cap_mb(model_fn, inputs, buckets)
    sides = [(scheme, which, Side(package, scheme, model_fn, inputs, cap))
             for scheme in schemes for which, package in (("before", before), ("now", now))]
    for _, _, side in sides:
        side.block(warmup, clock)
    times: list[list[float]] = [[] for _ in sides]
    for r in range(rounds):
        order = list(range(len(sides)))
        order = order[r % len(order):] + order[: r % len(order)]
        for i in order:
            times[i].append(sides[i][2].block(steps, clock))
        print(f"round {r + 1}/{rounds} done", flush=True)
    rows = []
    for i in range(0, len(sides), 2):
        scheme = sides[i][0]
        old, new = times[i], times[i + 1]
        same = all(torch.equal(a, b) for a, b in
                   zip(sides[i][2].weights(), sides[i + 1][2].weights(), strict=True))
        rows.append({"scheme": scheme,
                     "before_min_ms": 1e3 * min(old), "before_median_ms": 1e3 * statistics.median(old),
                     "now_min_ms": 1e3 * min(new), "now_median_ms": 1e3 * statistics.median(new),
                     "ratio_min": min(new) / min(old), "same_bits": same})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| scheme | before, min (ms) | before, median | now, min (ms) | now, median | "
             "now / before (min) | same bits |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| `{r['scheme']}` | {r['before_min_ms']:.3f} | {r['before_median_ms']:.3f} "
                     f"| {r['now_min_ms']:.3f} | {r['now_median_ms']:.3f} | {r['ratio_min']:.3f} "
                     f"| {'yes' if r['same_bits'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the revision to compare with")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--width", type=int, default=1)
    parser.add_argument("--buckets", type=int, default=4)
    parser.add_argument("--only", action="append", metavar="SCHEME",
                        help=f"time only these schemes (repeatable): {', '.join(SCHEMES)}")
    args = parser.parse_args(argv)
    for name in ("rounds", "steps", "width", "buckets"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    schemes = args.only or SCHEMES
    for scheme in schemes:
        if not scheme.startswith(("gradzip:", "gradzip-fused:")):
            parser.error(f"--only must name gradzip:SPEC or gradzip-fused:SPEC, got {scheme!r}")
    with tempfile.TemporaryDirectory(prefix="gradzip-before-") as tmp:
        try:
            before = load(extract(args.before, Path(tmp)))
        except ValueError as exc:
            parser.error(str(exc))
        now = importlib.import_module("gradzip")
        importlib.import_module("gradzip.ddp")
        rows = measure(before, now, schemes, width=args.width, buckets=args.buckets,
                       rounds=args.rounds, steps=args.steps, warmup=args.warmup)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    meta = {"before": args.before, "now": head or "working tree", "torch": torch.__version__,
            "model": f"resnet18 (CIFAR) width {args.width}", "buckets": args.buckets,
            "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
            "path": "device", "command": " ".join(sys.argv)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engine_ab.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1)
                                             + "\n")
    text = table(rows)
    (args.out / "engine_ab.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
