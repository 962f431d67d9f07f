"""Sending (value, index) pairs with one all-gather, shared by Top-k and hard threshold."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from gradzip.comm.base import Collective
from gradzip.compressors.base import (
    Job,
    SegmentPlan,
    gathered_or_dense_plan,
    give_averages,
    job_rows,
)
from gradzip.feedback import residual_unsent
from gradzip.ops.branches import cpu_form
from gradzip.ops.checks import check_on_device
from gradzip.ops.flat import cat_rows, reinterpret, to_device
from gradzip.ops.segmented import (
    MAX_ENTRIES,
    SegmentLayout,
    in_segments,
    segment_layout,
    segmented_topk,
)
from gradzip.ops.select import index_dtype, topk_abs

__all__ = ["exchange_positions", "gather_flat", "gather_full", "gather_sparse", "index_bytes",
           "scatter_decode", "select_positions"]


def index_bytes(numel: int) -> int:
    """Bytes per index on the wire: 4 (int32) where it fits, else 8."""
    return 4 if index_dtype(numel) == torch.int32 else 8


def _as_words(indices: torch.Tensor, numel: int) -> torch.Tensor:
    """Indices ``[L, m]`` reinterpreted as float32 words so values and indices share a buffer."""
    return indices.to(index_dtype(numel)).contiguous().view(torch.float32)


def _from_words(words: torch.Tensor, numel: int) -> torch.Tensor:
    return reinterpret(words, index_dtype(numel)).to(torch.int64)


def scatter_decode(values: torch.Tensor, indices: torch.Tensor, numel: int) -> torch.Tensor:
    """Sum ``values[R, m]`` at ``indices[R, m]`` into one dense vector of length ``numel``.

    Raises:
        ValueError: an index lies outside ``[0, numel)`` (a corrupt message; checked on the
            device, see :mod:`gradzip.ops.checks`: on CUDA the device asserts instead).
    """
    flat_idx = indices.reshape(-1)
    if flat_idx.numel():
        lo, hi = torch.aminmax(flat_idx)
        check_on_device(
            (lo >= 0) & (hi < numel), f"message indices must lie in [0, {numel})",
            lambda: f"message indices must lie in [0, {numel}), got range [{int(lo)}, {int(hi)}]",
        )
    out = torch.zeros(numel, dtype=values.dtype, device=values.device)
    # One row (one worker's message) at a time, in rank order: within a row every index is
    # distinct (padding adds zeros), so even atomic GPU scatters add in a fixed order and
    # every rank computes bit-identical averages.
    rows_idx = indices.reshape(indices.shape[0], -1) if indices.dim() > 1 else flat_idx[None]
    rows_val = values.reshape(rows_idx.shape)
    for row_idx, row_val in zip(rows_idx, rows_val, strict=True):
        out.index_add_(0, row_idx, row_val)
    return out


def _per_entry(per_job: Sequence[int], widths: Sequence[int], device: torch.device) -> torch.Tensor:
    """``per_job[j]`` repeated ``widths[j]`` times, as one int64 tensor (NumPy's ``repeat``:
    ``torch.repeat_interleave`` with a tensor of repeats is slow on the CPU)."""
    out = np.repeat(np.asarray(per_job, dtype=np.int64), np.asarray(widths, dtype=np.int64))
    # Page-locked and queued: a plain ``.to`` from pageable memory would make the host wait.
    return to_device(torch.from_numpy(out), device)


def _message(
    values: Sequence[torch.Tensor], indices: Sequence[torch.Tensor], width: int, workers: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """One job's ``[L, width]`` values and int64 indices, padded with (index 0, value 0)."""
    counts = [values[w].numel() for w in range(workers)]
    if all(c == width for c in counts):  # Top-k: every message is full, nothing to pad
        return (torch.stack(list(values[:workers])).to(torch.float32),
                torch.stack(list(indices[:workers])).to(torch.int64), counts)
    val = torch.zeros(workers, width, dtype=torch.float32, device=device)
    idx = torch.zeros(workers, width, dtype=torch.int64, device=device)
    for w in range(workers):
        val[w, : counts[w]] = values[w]
        idx[w, : counts[w]] = indices[w]
    return val, idx, counts


def gather_sparse(
    jobs: Sequence[Job],
    values: Sequence[Sequence[torch.Tensor]],
    indices: Sequence[Sequence[torch.Tensor]],
    widths: Sequence[int],
    comm: Collective,
    extra_payload: int = 0,
) -> None:
    """All-gather every job's sparse message in one buffer and decode the average.

    All jobs are decoded together: their indices are shifted into one flat space, so one
    ``index_add_`` per worker (and one division) fills every average, whatever the number of
    tensors. Each element receives the workers' entries in rank order.

    Args:
        jobs: the tensors, in an order identical on every worker.
        values, indices: per job, per local worker, 1-D tensors of at most ``widths[j]``
            entries (they may be shorter: they are padded with index 0 and value 0, which
            decode to nothing).
        widths: per job, the padded length, identical on every worker.
        comm: the collective.
        extra_payload: bytes of metadata per worker counted on top of values and indices
            (e.g. sizes sent beforehand are counted by that exchange, not here).

    A job that arrives without a residual gets one recorded here (:meth:`Job.keep`): its
    tensor with the sent entries zeroed (:func:`~gradzip.feedback.residual_unsent`;
    sparsifiers send entries unchanged, so that is exactly what error feedback keeps), from
    the unpadded indices.

    Raises:
        ValueError: a received index lies outside its tensor (a corrupt message; checked on
            the device, see :mod:`gradzip.ops.checks`: on CUDA the device asserts instead).
    """
    if not jobs:
        return
    workers = comm.local_workers
    device = jobs[0].tensor.device
    numels = [job.numel for job in jobs]
    parts: list[torch.Tensor] = []
    payload = [extra_payload] * workers
    for j, job in enumerate(jobs):
        val, idx, counts = _message(values[j], indices[j], widths[j], workers, device)
        for w in range(workers):
            payload[w] += counts[w] * (4 + index_bytes(numels[j]))
        parts.append(val)
        parts.append(_as_words(idx, numels[j]))
        if job.residual is None:  # Top-k; the threshold's one-pass split recorded its own
            job.keep(residual_unsent(job.tensor, indices[j]))
    gathered = comm.all_gather(torch.cat(parts, dim=1), payload=payload)
    received_val, received_idx, offset = [], [], 0
    for j, numel in enumerate(numels):
        width, words = widths[j], widths[j] * index_bytes(numel) // 4
        received_val.append(gathered[:, offset : offset + width])
        received_idx.append(_from_words(gathered[:, offset + width : offset + width + words], numel))
        offset += width + words
    idx_all = torch.cat(received_idx, dim=1)  # [W, sum(widths)], each job's own positions

    def explain() -> str:  # the CPU's precise message: the first job whose range is bad
        for j, numel in enumerate(numels):
            scatter_decode(received_val[j], received_idx[j], numel)
        return "message indices must lie in their tensors"

    _average(jobs, torch.cat(received_val, dim=1), idx_all, widths, comm, explain)


def _offsets(numels: Sequence[int]) -> list[int]:
    """Where each of tensors of ``numels`` entries starts when laid end to end, then the total."""
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + n)
    return offsets


def _average(
    jobs: Sequence[Job], flat_val: torch.Tensor, idx_all: torch.Tensor, widths: Sequence[int],
    comm: Collective, explain: Callable[[], str],
) -> None:
    """Every job's average from all workers' messages ``flat_val[W, K]`` and
    ``idx_all[W, K]`` (int64, each entry an index into its own job's tensor; job ``j`` owns
    ``widths[j]`` consecutive entries): one range check, one scatter per worker, one division.
    """
    device = flat_val.device
    numels = [job.numel for job in jobs]
    offsets = _offsets(numels)
    if idx_all.numel():
        limits = _per_entry(numels, widths, device)
        # Asserted on the device: a host read here would stall a CUDA stream once per call.
        check_on_device(((idx_all >= 0) & (idx_all < limits)).all(),
                        "message indices must lie in their tensors", explain)
    shifts = _per_entry(offsets[:-1], widths, device)
    total = torch.zeros(offsets[-1], dtype=torch.float32, device=device)
    flat_idx = idx_all + shifts
    # One worker's row at a time, in rank order: a row never holds an index twice (padding
    # adds zeros), so even atomic GPU scatters add in a fixed order and every rank computes
    # bit-identical averages (a decision taken from them must agree across ranks).
    for row_idx, row_val in zip(flat_idx, flat_val, strict=True):
        total.index_add_(0, row_idx, row_val)
    give_averages(jobs, total.div_(comm.world_size))


def gather_full(
    jobs: Sequence[Job], values: torch.Tensor, indices: torch.Tensor, widths: Sequence[int],
    comm: Collective,
) -> None:
    """:func:`gather_sparse` for messages that are all full (Top-k), given for all jobs at once:
    a few ops per call whatever the number of tensors.

    Args:
        jobs: the tensors, in an order identical on every worker.
        values, indices: ``[L, K]``, job ``j``'s ``widths[j]`` entries after those of the jobs
            before it; indices are int64 positions in the job's own tensor.
        widths: per job, its number of entries (identical on every worker).
        comm: the collective.

    The message carries all values, then all indices as int32 (where a tensor needs int64
    indices, the call goes through :func:`gather_sparse`); the bytes counted are the same.
    Residuals and averages are those of :func:`gather_sparse`, bit for bit.

    Raises:
        ValueError: a received index lies outside its tensor (as :func:`gather_sparse`).
    """
    if not jobs:
        return
    workers = comm.local_workers
    numels = [job.numel for job in jobs]
    if any(index_dtype(n) != torch.int32 for n in numels):
        starts = _offsets(widths)
        parts = [(values[:, a:b], indices[:, a:b]) for a, b in zip(starts[:-1], starts[1:], strict=True)]
        gather_sparse(jobs, [list(v) for v, _ in parts], [list(i) for _, i in parts], widths, comm)
        return
    device = values.device
    if any(job.residual is None for job in jobs):
        # Every job's tensor with its sent entries zeroed (what residual_unsent gives), in
        # one scatter over the call's tensors laid end to end.
        offsets = _offsets(numels)
        rest = cat_rows([job.tensor for job in jobs], workers)
        rest.scatter_(1, indices + _per_entry(offsets[:-1], widths, device), 0.0)
        for j, job in enumerate(jobs):
            if job.residual is None:
                job.keep(rest[:, offsets[j] : offsets[j + 1]].reshape(job.tensor.shape))
    count = values.shape[1]
    payload = [count * 8] * workers
    words = indices.to(torch.int32).contiguous().view(torch.float32)  # every index fits
    message = torch.cat([values.to(torch.float32), words], dim=1)
    gathered = comm.all_gather(message, payload=payload)
    received_val = gathered[:, :count]
    received_idx = reinterpret(gathered[:, count:], torch.int32).to(torch.int64)

    def explain() -> str:  # the CPU's precise message: the first job whose range is bad
        starts = _offsets(widths)
        for j, numel in enumerate(numels):
            a, b = starts[j], starts[j + 1]
            scatter_decode(received_val[:, a:b], received_idx[:, a:b], numel)
        return "message indices must lie in their tensors"

    _average(jobs, received_val, received_idx, widths, comm, explain)


def gather_flat(
    jobs: Sequence[Job], flat: torch.Tensor, positions: torch.Tensor, layout: SegmentLayout,
    comm: Collective, values: torch.Tensor | None = None, left: torch.Tensor | None = None,
) -> torch.Tensor:
    """All-gather one whole-message selection and decode every job's average, in a fixed
    number of ops whatever the number of tensors (:func:`exchange_positions`, with each
    job's residual and average handed over as views).

    Args:
        jobs: the tensors, in an order identical on every worker, laid end to end in ``flat``.
        flat, positions, layout, comm, values, left: as :func:`exchange_positions`.

    Returns:
        ``[W, K]``: every worker's values, in rank order.

    Raises:
        ValueError: as :func:`exchange_positions`.
    """
    total, received_val = exchange_positions(flat, positions, layout, comm, values, left)
    for job, part in zip(jobs, job_rows(jobs, flat), strict=True):
        job.keep(part)
    give_averages(jobs, total.div_(comm.world_size))
    return received_val


def positions_plan(
    forms: Sequence[str], sizes: Sequence[int], picks_for: Callable[[int], int],
    device: torch.device,
) -> SegmentPlan | None:
    """The segment plan of a sparsifier that sends ``picks_for(n)`` positions of each
    all-gathered tensor of ``n`` entries (Top-k's ``k``, the threshold's slots): the plan of
    :func:`~gradzip.compressors.base.gathered_or_dense_plan` whose data is the all-gathered
    tensors' :class:`~gradzip.ops.segmented.SegmentLayout`, where their flat positions fit
    int32 (:data:`~gradzip.ops.segmented.MAX_ENTRIES`); else ``None``."""
    def layout(picked: list[int]) -> SegmentLayout:
        numels = [sizes[i] for i in picked]
        return segment_layout(numels, [picks_for(n) for n in numels], device)

    return gathered_or_dense_plan(forms, sizes, layout, most=MAX_ENTRIES)


def exchange_positions(
    flat: torch.Tensor, positions: torch.Tensor, layout: SegmentLayout, comm: Collective,
    values: torch.Tensor | None = None, left: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather one whole-message selection of the flat rows ``flat`` and sum what every
    worker sent: a fixed number of ops whatever the number of segments (tensors).

    The message of a local worker is its ``K`` values (fp32) then their positions in the
    call's flat row (int32; :data:`~gradzip.ops.segmented.MAX_ENTRIES` bounds a layout), so
    no per-tensor shift is needed on either side. The bytes counted are those of every
    tensor's entries with int32 indices, as :func:`gather_full` counts them.

    Args:
        flat: ``[L, N]`` float32, the segments laid end to end: a buffer of the caller's,
            overwritten with the residuals (what was not sent).
        positions: ``[L, K]`` int64, each segment's selected positions in the row (segment
            after segment, ``layout.picks[j]`` for segment ``j``).
        layout: the selection's :func:`~gradzip.ops.segmented.segment_layout`.
        comm: the collective.
        values: ``[L, K]``, what to send at ``positions`` where it is not ``flat``'s entries
            there (the threshold's: zero where an entry is not sent), with ``left``, what the
            residual keeps there (``flat``'s entry minus ``values``). ``None``: ``flat``'s
            entries, all sent, and zeros left.

    Returns:
        ``(total, received)``: ``[N]`` the sum over workers of what they sent (a new
        tensor), and ``[W, K]`` every worker's values, in rank order.

    Raises:
        ValueError: a received position lies outside its segment (a corrupt message; checked
            on the device, see :mod:`gradzip.ops.checks`: on CUDA the device asserts instead).
    """
    workers, count = positions.shape
    device = flat.device
    message = torch.empty(workers, 2 * count, dtype=torch.float32, device=device)
    if values is None:
        torch.gather(flat, 1, positions, out=message[:, :count])
        flat.scatter_(1, positions, 0.0)  # what was sent leaves the residual
    else:
        assert left is not None
        message[:, :count] = values
        flat.scatter_(1, positions, left)
    message[:, count:].view(torch.int32).copy_(positions)
    gathered = comm.all_gather(message, payload=[count * 8] * workers)
    received_val = gathered[:, :count]
    received_pos = gathered[:, count:].view(torch.int32).contiguous()  # rows of the buffer

    def explain() -> str:  # the CPU's precise message: the first segment whose range is bad
        starts = layout.starts()
        for j, numel in enumerate(layout.sizes):
            a, b = sum(layout.picks[:j]), sum(layout.picks[: j + 1])
            part = received_pos[:, a:b].to(torch.int64) - starts[j]
            scatter_decode(received_val[:, a:b], part, numel)
        return "message indices must lie in their tensors"

    check_on_device(in_segments(received_pos, layout), "message indices must lie in their tensors",
                    explain)
    total = torch.zeros(layout.total, dtype=torch.float32, device=device)
    # One worker's row at a time, in rank order: a row never holds a position twice, so even
    # atomic GPU scatters add in a fixed order and every rank computes the same bits.
    for row_pos, row_val in zip(received_pos, received_val, strict=True):
        total.index_add_(0, row_pos, row_val)
    return total, received_val


def select_positions(flat: torch.Tensor, layout: SegmentLayout) -> torch.Tensor:
    """Each segment's ``layout.picks[j]`` largest-magnitude entries of every row of
    ``flat[L, N]``, as ``[L, K]`` int64 flat positions, segment after segment.

    Off the CPU: :func:`~gradzip.ops.segmented.segmented_topk`, a fixed number of ops for
    the whole call. On the CPU, one exact selection per distinct segment size
    (:func:`~gradzip.ops.select.topk_abs`, whose narrowing pass is much faster there than a
    sort of the whole row): the same entries, ties aside.
    """
    if not cpu_form(flat.device):
        return segmented_topk(flat, layout)
    workers = flat.shape[0]
    starts = layout.starts()
    groups: dict[tuple[int, int], list[int]] = {}
    for i, size_pick in enumerate(zip(layout.sizes, layout.picks, strict=True)):
        groups.setdefault(size_pick, []).append(i)
    picked: list[torch.Tensor] = [torch.empty(0)] * len(layout.sizes)
    for (_, k), members in groups.items():
        parts = [flat[:, starts[i] : starts[i + 1]] for i in members]
        rows = parts[0] if len(parts) == 1 else torch.cat(parts)
        _, idx = topk_abs(rows, k)
        for g, i in enumerate(members):
            picked[i] = idx[g * workers : (g + 1) * workers] + starts[i]
    return torch.cat(picked, dim=1)
