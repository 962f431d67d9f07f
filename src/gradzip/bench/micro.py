"""Kernel benchmark: compress, and decode-and-average four workers' messages, in one process.

What is timed, for one worker of a group of ``W`` (default 4):

1. A *recording* step collects what each of ``W`` workers (``W`` different gradients) hands to
   every collective call: each worker runs ``compressor.reduce`` alone (one worker's memory at
   a time), seeing the others' messages of the previous pass, until the messages settle (see
   :func:`~gradzip.bench.replay.record_messages`).
2. Each timed pass runs ``compressor.reduce`` for worker 0 alone, in a group of ``W`` whose
   collectives take the recorded messages of the other workers: an all-reduce adds the ``W``
   messages in this process (the arithmetic a CPU backend does; nothing travels), an
   all-gather stacks them. The result is what worker 0 would compute in a real group, minus
   the transport.
3. ``compress`` is the time from the start of ``reduce`` to the entry of its *last* collective
   (selection, packing, the worker's own decoded message that error feedback needs, and for
   PowerSGD the first round including the sum of the ``P`` factors and their
   orthogonalisation); ``decode`` is the rest (the last collective's local work, unpacking,
   the sum over workers and the division).

Beside them: ``tensor.clone()`` of the same tensor (the memory-bandwidth yardstick) and, where
an obvious baseline exists, that baseline: ``torch.topk`` of the magnitudes for Top-k, and the
arithmetic of PyTorch's built-in ``powerSGD_hook`` for PowerSGD (per matrix ``P = M Q``, its
``_orthogonalize``, ``Q = M^T P``; decoding ``P Q^T`` into a preallocated buffer).
"""

from __future__ import annotations

import copy
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from gradzip._validate import check_int
from gradzip.bench.common import Heap
from gradzip.bench.replay import RecordedGroup, record_messages
from gradzip.compressors.base import Compressor, Job, StepContext
from gradzip.ops import jit, select
from gradzip.ops.random import generator_for
from gradzip.spec import compressor_from_spec

__all__ = ["DEFAULT_NUMELS", "MICRO_SPECS", "MicroRow", "jobs_for", "powersgd_layout", "run_micro"]

log = logging.getLogger(__name__)

#: 1M (2**20), ResNet-18's parameter count, 64M (2**26).
DEFAULT_NUMELS = (1_048_576, 11_173_962, 67_108_864)

#: |x| >= this keeps 1% of standard-normal entries (the 99.5% quantile of N(0, 1)).
THRESHOLD_LAM = 2.5758

MICRO_SPECS = (
    "none",
    "fp16",
    "bf16",
    "topk:ratio=0.01",
    "randk:ratio=0.01",
    f"threshold:lam={THRESHOLD_LAM}",
    "powersgd:rank=4",
    "qsgd:levels=8",
    "sign",
)

# ResNet-18's 3x3 convolutions, largest first; PowerSGD sees each as [out, in * 9].
_CONV_SHAPES = ((512, 512, 3, 3), (256, 256, 3, 3), (128, 128, 3, 3), (64, 64, 3, 3))


@dataclass
class MicroRow:
    """One compressor at one tensor size. Times are medians in seconds."""

    compressor: str
    numel: int
    layout: str
    compress_seconds: float
    decode_seconds: float
    clone_seconds: float
    baseline_seconds: float | None
    baseline: str | None
    baseline_decode_seconds: float | None
    select_seconds: float | None
    density: float | None
    workers: int
    threads: int
    repeat: int
    heap: str
    #: ``"compiled"`` when :mod:`gradzip.ops.jit`'s kernels ran (Numba installed and not
    #: switched off by ``GRADZIP_JIT=0``), ``"fallback"`` for the NumPy and torch paths.
    kernels: str = "fallback"

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["compress_over_clone"] = self.compress_seconds / self.clone_seconds
        out["baseline_over_compress"] = (
            self.baseline_seconds / self.compress_seconds if self.baseline_seconds else None
        )
        return out


def powersgd_layout(numel: int) -> list[tuple[int, tuple[int, ...]]]:
    """``[(count, conv shape), ...]``: ResNet-18's 3x3 convolutions, largest first, as many of
    each as fit, filling about ``numel`` entries (one small matrix below a conv's size)."""
    layout = []
    left = numel
    for shape in _CONV_SHAPES:
        count = left // math.prod(shape)
        if count:
            layout.append((count, shape))
            left -= count * math.prod(shape)
    if not layout:  # smaller than any conv: one [rows, 64] matrix
        layout.append((1, (max(1, numel // 64), min(numel, 64))))
    return layout


def jobs_for(spec: str, data: torch.Tensor) -> tuple[list[Job], str]:
    """The jobs the benchmark hands ``spec``'s compressor: views of ``data``, never copies.

    Args:
        spec: a compressor spec; PowerSGD gets ResNet-18-shaped convolutions
            (:func:`powersgd_layout`), every other compressor one flat tensor.
        data: ``[workers, numel]``, one row per worker.

    Returns:
        The jobs (each ``[workers, *shape]``) and the layout as text, e.g. ``"[70000]"``.
    """
    workers, numel = data.shape
    if spec.startswith("powersgd"):
        jobs, parts, offset = [], [], 0
        for count, shape in powersgd_layout(numel):
            size = math.prod(shape)
            for _ in range(count):
                view = data[:, offset : offset + size].reshape(workers, *shape)
                jobs.append(Job(f"conv{len(jobs)}", view))
                offset += size
            parts.append(f"{count}x{list(shape)}")
        return jobs, " + ".join(parts)
    return [Job("flat", data)], f"[{numel}]"


def _builtin_powersgd(
    mats: Sequence[torch.Tensor], matrix_rank: int
) -> tuple[Callable[[], None], Callable[[], None], str]:
    """Compress and decode closures doing the arithmetic of PyTorch's ``powerSGD_hook``."""
    try:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

        name = "powerSGD_hook math (bmm, _orthogonalize, bmm)"
    except ImportError:  # pragma: no cover - depends on the torch build

        def _orthogonalize(m: torch.Tensor, epsilon: float = 0) -> None:
            m.copy_(torch.linalg.qr(m).Q)

        name = "powerSGD_hook math (bmm, QR, bmm)"
    gen = generator_for("bench-builtin-q")
    mats3 = [m.unsqueeze(0) for m in mats]  # the hook's unbatched layout: [1, rows, cols]
    ps = [torch.empty(1, m.shape[1], matrix_rank) for m in mats3]
    qs = [torch.randn(1, m.shape[2], matrix_rank, generator=gen) for m in mats3]
    outs = [torch.empty_like(m) for m in mats3]

    def compress() -> None:
        for m, q, p in zip(mats3, qs, ps, strict=True):
            torch.bmm(m, q, out=p)
        for p in ps:
            _orthogonalize(p)
        for m, p, q in zip(mats3, ps, qs, strict=True):
            torch.bmm(m.transpose(1, 2), p, out=q)

    def decode() -> None:
        for p, q, out in zip(ps, qs, outs, strict=True):
            torch.bmm(p, q.transpose(1, 2), out=out)

    return compress, decode, name


def _select_op(compressor: Compressor, data: torch.Tensor) -> Callable[[], object] | None:
    """The selection op a sparsifier's ``reduce`` runs, alone, on worker 0's tensor."""
    if compressor.spec_name == "topk":
        k = compressor.k_for(data.shape[1])  # type: ignore[attr-defined]
        return lambda: select.topk_abs(data, k)
    if compressor.spec_name == "threshold" and compressor.lam is not None:  # type: ignore[attr-defined]
        lam = compressor.lam  # type: ignore[attr-defined]
        return lambda: select.threshold_split(data, lam)
    return None


def _measure(spec: str, data: torch.Tensor, repeat: int, threads: int, heap: Heap) -> MicroRow:
    """One row. Every repetition times, back to back, the clone, the compressor's step and
    the baselines, so the ratios compare figures taken under the same machine load."""
    workers = data.shape[0]
    compressor = compressor_from_spec(spec)
    jobs, layout = jobs_for(spec, data)
    numel = sum(j.numel for j in jobs)
    state0 = compressor.init_state({j.name: j.shape for j in jobs})
    recorded = record_messages(
        compressor, state0, lambda w: [Job(j.name, j.tensor[w : w + 1]) for j in jobs], workers
    )
    mine = [Job(j.name, j.tensor[:1]) for j in jobs]
    ctx = StepContext(step=0, ranks=(0,), world_size=workers)
    flat0 = data[:1, :numel]

    def timed(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def step() -> tuple[float, float]:
        exchange = RecordedGroup(workers, 0, recorded)
        step_jobs = [Job(j.name, j.tensor) for j in mine]
        state = copy.copy(state0)  # compressors replace entries, never write into them
        start = time.perf_counter()
        compressor.reduce(step_jobs, state, exchange, ctx)
        end = time.perf_counter()
        last = exchange.entries[-1] if exchange.entries else end
        return last - start, end - last

    extra: dict[str, Callable[[], object]] = {}
    baseline_name = density = None
    if compressor.spec_name == "topk":
        k = compressor.k_for(numel)  # type: ignore[attr-defined]
        extra["baseline"] = lambda: torch.topk(flat0.abs(), k, dim=1, sorted=False)
        baseline_name = "torch.topk(x.abs(), k)"
        density = k / numel
    elif compressor.spec_name == "powersgd":
        mats = [j.tensor[0].reshape(j.shape[0], -1) for j in jobs]
        extra["baseline"], extra["baseline_decode"], baseline_name = _builtin_powersgd(
            mats, compressor.matrix_rank  # type: ignore[attr-defined]
        )
    elif compressor.spec_name == "threshold":
        density = float((flat0.abs() >= compressor.lam).sum()) / numel  # type: ignore[attr-defined]
    elif compressor.spec_name == "randk":
        density = compressor.k_for(numel) / numel  # type: ignore[attr-defined]
    op = _select_op(compressor, flat0)
    if op is not None:
        extra["select"] = op

    samples: dict[str, list[float]] = {"clone": [], "compress": [], "decode": []}
    samples.update({key: [] for key in extra})
    for rep in range(repeat + 1):  # the first repetition warms up and is dropped
        clone = timed(flat0.clone)
        compress, decode = step()
        others = {key: timed(fn) for key, fn in extra.items()}
        if rep:
            samples["clone"].append(clone)
            samples["compress"].append(compress)
            samples["decode"].append(decode)
            for key, value in others.items():
                samples[key].append(value)
    med = {key: statistics.median(values) for key, values in samples.items()}
    return MicroRow(
        compressor=spec, numel=numel, layout=layout, compress_seconds=med["compress"],
        decode_seconds=med["decode"], clone_seconds=med["clone"],
        baseline_seconds=med.get("baseline"), baseline=baseline_name,
        baseline_decode_seconds=med.get("baseline_decode"), select_seconds=med.get("select"),
        density=density, workers=workers, threads=threads, repeat=repeat, heap=heap.mode,
        kernels="compiled" if jit.enabled() else "fallback",
    )


def run_micro(
    numels: Sequence[int] = DEFAULT_NUMELS,
    specs: Sequence[str] = MICRO_SPECS,
    *,
    repeat: int = 5,
    workers: int = 4,
    threads: int | None = None,
    heap: str = "warm",
    on_row: Callable[[MicroRow], None] | None = None,
) -> list[MicroRow]:
    """Time every compressor at every size (see the module docstring for what is timed).

    Args:
        numels: tensor sizes in entries (PowerSGD uses the nearest whole number of convs).
        specs: compressor spec strings.
        repeat: timed repetitions per figure (the median is reported), after one warm-up.
        workers: the group size whose messages are decoded and averaged (>= 2).
        threads: ``torch.set_num_threads`` for the run (``None``: leave as it is).
        heap: ``"warm"`` or ``"default"`` large allocations (see
            :class:`~gradzip.bench.common.Heap`; either changes this process's
            allocator for good).
        on_row: called with each row as soon as it is measured.

    Returns:
        One row per (size, compressor).

    Raises:
        ValueError: invalid arguments.
    """
    repeat = check_int("repeat", repeat, minimum=1)
    workers = check_int("workers", workers, minimum=2)
    numels = [check_int("numel", n, minimum=1) for n in numels]
    for spec in specs:
        compressor_from_spec(spec)  # fail before any measurement on a bad spec
    if threads is not None:
        torch.set_num_threads(check_int("threads", threads, minimum=1))
    threads = torch.get_num_threads()
    managed = Heap(heap)
    rows = []
    for numel in numels:
        gen = generator_for("bench-micro", numel)
        data = torch.randn(workers, numel, generator=gen)
        for spec in specs:
            row = _measure(spec, data, repeat, threads, managed)
            log.info("%s", row)
            rows.append(row)
            if on_row is not None:
                on_row(row)
        del data
    return rows
