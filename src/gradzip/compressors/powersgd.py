"""PowerSGD: rank-r approximation by one step of subspace iteration, warm-started."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gradzip._validate import check_bool, check_int, check_real
from gradzip.comm.base import Collective
from gradzip.compressors.base import (
    Compressor,
    Job,
    SegmentPlan,
    StepContext,
    give_averages,
    job_rows,
)
from gradzip.compressors.none import NoCompression
from gradzip.ops.finite import finite_rows
from gradzip.ops.flat import flatten_workers, split_flat, to_device
from gradzip.ops.lowrank import (
    ALIGN_BYTES,
    aligned_matrices,
    orthogonalize,
    orthonormal_many,
    rescale_exponents,
    stack_matrices,
    stack_region,
)
from gradzip.ops.multi import copy_many, sub_many_
from gradzip.ops.random import generator_for
from gradzip.ops.segments import matrix_index, per_matrix_absmax

__all__ = ["PowerSGD", "reduce_row", "reduce_together", "row_plan"]


# A warm start whose largest entry exceeds this is scaled down by a power of two (see _tame).
_Q_LIMIT = 2.0**32


def _tame_shifts(top: torch.Tensor) -> torch.Tensor:
    """The power-of-two scale of each warm start whose largest absolute entry is ``top``
    (elementwise): the one that brings it to at most 1 where it exceeds :data:`_Q_LIMIT` (and
    is finite), else exactly 1. Computed on the device, without a host synchronisation.

    ``Q = M^T P`` carries the gradient's magnitude (only ``P`` is orthonormal), and the next
    step multiplies it by the next gradient: after one huge but finite gradient, every later
    product would overflow, and each step would be skipped forever. Only the column space of
    ``Q`` matters (``P = orthogonalize(M Q)``), and a power-of-two scale is exact, so this
    changes nothing else; ordinary warm starts never reach the limit and stay bit-identical.
    """
    huge = (top > _Q_LIMIT) & (top < torch.inf)  # top >= 0: finite in one op
    return torch.exp2(-torch.ceil(torch.log2(torch.where(huge, top, 1.0))))


def _tame(q: torch.Tensor) -> torch.Tensor:
    """Each matrix of ``q`` (``[..., a, b]``) times its :func:`_tame_shifts` scale."""
    if q.numel() == 0:
        return q
    return q * _tame_shifts(q.abs().amax(dim=(-2, -1), keepdim=True))


def _tops(
    region: torch.Tensor, sizes: list[int], counts: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest absolute entry of each matrix of a 1-D ``region`` made of groups of
    ``sizes[i]`` entries, each ``counts[i]`` equal-size matrices one after another:
    ``[sum(counts)]``, in order, and the region's entry-to-matrix index (see
    :mod:`gradzip.ops.segments`: a few ops for the region whatever the number of groups)."""
    index = matrix_index(sizes, counts, region.device)
    return per_matrix_absmax(region, index, sum(counts)), index


def _each_worker(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``a[B, x, y] @ b[w]`` for every worker ``w`` of ``b[L, B, y, z]``, written into
    ``out[L, B, x, z]`` (each matrix at an aligned place, see :func:`_products`); returns
    ``out``.

    One batched GEMM per local worker (one in a real process group), never a matmul
    broadcast over the worker axis: that would copy ``a`` into a new layout, and the GEMM
    would round differently with the number of workers a process holds (the simulator's
    results must equal a process group's bit for bit). The BLAS rounds a product differently
    with where its output lies, so the output's place is fixed by the shape alone.
    """
    # ``bmm`` where no matrix dimension is 1: then ``matmul`` of two batches of equal size
    # reshapes them to themselves and calls the same kernel on the same operands, and skipping
    # it saves the dozen views its broadcasting logic makes on the host per product. With a
    # dimension of 1 (rank 1) ``matmul``'s reshapes give that dimension other strides, which
    # decide the BLAS's layout and so its bits: kept, so that a matrix rounds alike in any batch.
    product = torch.bmm if 1 not in (*a.shape[-2:], b.shape[-1]) else torch.matmul
    for w in range(b.shape[0]):
        product(a, b[w], out=out[w])
    return out


def _products(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    given: Sequence[torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """:func:`_each_worker` of each ``(a[B, x, y], b[L, B, y, z])``, the ``[L, B, x, z]``
    outputs placed by one :func:`~gradzip.ops.lowrank.aligned_matrices` call (one allocation
    and a few views per group, instead of an allocation and its views per product): each
    matrix still at an aligned place of its own, so each product rounds as it would alone.
    ``given[i]``, where not ``None``, is the output of pair ``i`` instead (its matrices laid
    out as those of ``aligned_matrices``, at aligned places: the same bits)."""
    if not pairs:
        return []
    given = given if given is not None else [None] * len(pairs)
    a0, b0 = pairs[0]
    wanted = [(a.shape[0], a.shape[1], b.shape[-1])
              for (a, b), out in zip(pairs, given, strict=True) if out is None]
    made = iter(aligned_matrices((b0.shape[0],), wanted, dtype=a0.dtype, device=b0.device)
                if wanted else [])
    return [_each_worker(a, b, out if out is not None else next(made))
            for (a, b), out in zip(pairs, given, strict=True)]


def _group_views(flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Consecutive views ``[L, *shape]`` of a ``[L, total]`` buffer, one per shape."""
    sizes = [math.prod(shape) for shape in shapes]
    return [part.view(flat.shape[0], *shape)
            for part, shape in zip(flat.split(sizes, dim=1), shapes, strict=True)]


def _mean(total: torch.Tensor, world: int) -> torch.Tensor:
    """An all-reduced sum (a fresh tensor) divided by the world size, in place; with one
    worker the division by 1 is exact and skipped."""
    return total.div_(world) if world > 1 else total


def _matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """Tensors are seen as ``[shape[0], prod(shape[1:])]`` (a conv kernel by output channel)."""
    return int(shape[0]), int(math.prod(shape[1:]))


@dataclass(frozen=True)
class PowerSGD(Compressor):
    """Rank-``matrix_rank`` compression by power iteration with a warm start.

    For each matrix ``M`` (a tensor reshaped to ``[rows, cols]``): ``P = M Q`` is all-reduced and
    orthogonalised, then ``Q = M^T P`` is all-reduced; the average is ``P Q^T / W``. ``Q`` is
    kept for the next step (warm start), so one iteration per step converges over steps.
    The matrices of a call are grouped by shape, and each group is one batch: every product,
    the orthogonalisation, the residuals and the warm starts' taming are a few ops per group
    (the rescaling scales and the finiteness test a few per call), so a call's ops grow with
    its number of distinct shapes, not of tensors. All ``P`` factors (with the tensors sent
    dense) travel in one flat buffer, all ``Q`` factors in a second one: two all-reduces per
    step, however many tensors. Warm starts stay keyed by parameter name (``[cols, r]`` each).

    Tensors with fewer than two dimensions, and matrices whose compression rate
    ``rows * cols / (matrix_rank * (rows + cols))`` is below ``min_compression_rate``, are sent dense.

    Args:
        matrix_rank: the rank of the approximation (>= 1); ``rank`` in spec strings.
        power_iterations: subspace iterations per step (>= 1); more is closer to the best
            rank-r approximation, each costs two more all-reduces.
        min_compression_rate: tensors that low rank would shrink less than this go dense (>= 1).
        warm_start: reuse the previous step's ``Q``; otherwise draw a fresh one each step.
        seed: seed of the initial ``Q`` (identical on every worker).

    References:
        Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
        Distributed Optimization", NeurIPS 2019.
    """

    matrix_rank: int = 1
    power_iterations: int = 1
    min_compression_rate: float = 2.0
    warm_start: bool = True
    seed: int = 0
    spec_name: ClassVar[str] = "powersgd"
    device_decisions: ClassVar[bool] = True
    spec_aliases: ClassVar[dict[str, str]] = {"rank": "matrix_rank"}

    def __post_init__(self) -> None:
        object.__setattr__(self, "matrix_rank", check_int("matrix_rank", self.matrix_rank, minimum=1))
        object.__setattr__(
            self, "power_iterations", check_int("power_iterations", self.power_iterations, minimum=1)
        )
        object.__setattr__(
            self,
            "min_compression_rate",
            check_real("min_compression_rate", self.min_compression_rate, low=1),
        )
        check_bool("warm_start", self.warm_start)
        object.__setattr__(self, "seed", check_int("seed", self.seed, minimum=0))

    # -- which tensors are compressed -----------------------------------------------------
    def matrix_rank_for(self, shape: torch.Size) -> int:
        """The rank used for a tensor of ``shape``, or 0 when it is sent dense."""
        if len(shape) < 2:
            return 0
        rows, cols = _matrix_shape(shape)
        r = min(self.matrix_rank, rows, cols)
        if rows * cols < self.min_compression_rate * r * (rows + cols):
            return 0
        return r

    def _fresh_q(self, name: str, shape: torch.Size, step: int) -> torch.Tensor:
        return self._draw_q(name, _matrix_shape(shape)[1], self.matrix_rank_for(shape), step)

    def _draw_q(self, name: str, cols: int, rank: int, step: int) -> torch.Tensor:
        """A fresh ``Q`` ``[cols, rank]`` for tensor ``name`` at ``step``, the same on every
        worker."""
        gen = generator_for("powersgd-q", self.seed, name, step)
        return torch.randn(cols, rank, generator=gen)

    def init_state(self, shapes: Mapping[str, torch.Size]) -> dict[str, Any]:
        return {
            "q": {
                name: self._fresh_q(name, torch.Size(shape), -1)
                for name, shape in shapes.items()
                if self.matrix_rank_for(torch.Size(shape))
            }
        }

    # -- the algorithm --------------------------------------------------------------------
    def _groups(
        self, jobs: Sequence[Job]
    ) -> tuple[list[Job], list[tuple[int, int, int]], dict[tuple[int, int, int], list[Job]]]:
        """The jobs sent dense, the group keys ``(rows, cols, rank)`` in the order every
        worker uses, and the jobs of each group (in call order)."""
        dense = []
        groups: dict[tuple[int, int, int], list[Job]] = {}
        for job in jobs:
            key = self._group_key(job.shape)
            if key is None:
                dense.append(job)
            else:
                groups.setdefault(key, []).append(job)
        return dense, sorted(groups), groups  # sorted: identical order on every worker

    def _group_key(self, shape: torch.Size) -> tuple[int, int, int] | None:
        """The group ``(rows, cols, rank)`` of a tensor of ``shape``, or ``None`` where it is
        sent dense."""
        r = self.matrix_rank_for(shape)
        return (*_matrix_shape(shape), r) if r else None

    def _warm_starts(self, names: Sequence[str], key: tuple[int, ...],
                     state: dict[str, Any], ctx: StepContext, device: torch.device) -> torch.Tensor:
        """``Q^T`` of a group's matrices (``names``, group ``key``), ``[B, r, cols]``: the
        stored warm starts (without a copy when they are still where ``reduce`` stored them)
        or fresh draws. Either way a transposed view of ``[B, cols, r]``, the layout of a
        checkpoint's ``Q``, each matrix at an aligned place, so that the products round the
        same after a resume."""
        cols, r = key[1], key[2]
        if self.warm_start:
            stored = [to_device(state["q"][name], device) for name in names]
        else:
            stored = [to_device(self._draw_q(name, cols, r, ctx.step), device) for name in names]
        # A view where they lie at aligned places one step apart (as reduce stores them),
        # else one copy.
        return stack_matrices([q.unsqueeze(0) for q in stored], cols, r)[0].transpose(-1, -2)

    def reduce(
        self, jobs: Sequence[Job], state: dict[str, Any], comm: Collective, ctx: StepContext
    ) -> None:
        reduce_together([(self, jobs, state)], comm, ctx)

    def shares_exchange(self, other: Compressor) -> bool:
        """Whether ``other`` may reduce its jobs in one exchange with this one
        (:func:`reduce_together`): a PowerSGD the same but for ``matrix_rank`` and
        ``min_compression_rate``, which only decide each tensor's group, or ``none``, whose
        tensors ride in the first message as PowerSGD's own dense tensors do (the exact
        average and a zero residual either way)."""
        if isinstance(other, NoCompression):
            return True
        return isinstance(other, PowerSGD) and dataclasses.replace(
            other, matrix_rank=self.matrix_rank,
            min_compression_rate=self.min_compression_rate) == self

    # -- the call as one row (the engine's segment path) ----------------------------------
    def segment_plan(
        self, names: Sequence[str], sizes: Sequence[int], world_size: int, device: torch.device,
        shapes: Sequence[torch.Size] | None = None, *, state: Mapping[str, Any] | None = None,
    ) -> SegmentPlan | None:
        """The row's order (see :meth:`~gradzip.compressors.base.Compressor.segment_plan`):
        each group of same-shape matrices, its tensors in the engine's order, then the
        tensors sent dense. The groups whose matrices fill whole multiples of
        :data:`~gradzip.ops.lowrank.ALIGN_BYTES` come first, so that each of their matrices
        lies at an aligned place in the row and is read, and averaged, in place; the others
        follow (each read from one copy). Only their places in the row differ from
        :meth:`reduce`: the messages keep its order. ``None`` without the tensors' ``shapes``
        (a matrix's rows and columns are not in its size)."""
        if shapes is None or len(shapes) != len(names):
            return None
        return row_plan([self], [0] * len(names), names, sizes, shapes)

    def reduce_segments(
        self, flat: torch.Tensor, plan: SegmentPlan, state: dict[str, Any], comm: Collective,
        ctx: StepContext, raw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`reduce` on tensors already laid end to end in ``plan``'s order (see
        :meth:`~gradzip.compressors.base.Compressor.reduce_segments`): the same messages,
        state and bits, each group's matrices read from the row (viewed where they lie at
        aligned places, else one copy per group) and its residuals written back into it."""
        return reduce_row(self, flat, plan.data, [state], comm, ctx)

    # -- the algorithm on groups of matrices (both forms) ---------------------------------
    def _exchange(
        self, keys: list[tuple[int, ...]], names: dict[tuple[int, ...], list[str]],
        mats: dict[tuple[int, ...], torch.Tensor], riders: list[torch.Tensor],
        residuals: torch.Tensor, rests: list[torch.Tensor],
        states: Mapping[Any, dict[str, Any]], comm: Collective, ctx: StepContext,
        dense_out: torch.Tensor | None = None,
        averages: list[torch.Tensor | None] | None = None,
    ) -> _Exchanged:
        """The power iteration of a call, its two all-reduces and its new warm starts
        (stored in each group's state).

        Args:
            keys: the groups ``(rows, cols, rank, ...)`` (a part's index may follow), in the
                order every worker uses.
            names: each group's tensors, in call order.
            mats: each group's matrices, ``[L, B, rows, cols]``, each at an aligned place.
            riders: the tensors sent dense (``[L, ...]`` each), riding in the first message.
            residuals: ``[L, sum of the groups' entries]``, every group's residual (tested
                for finiteness as one tensor).
            rests: per group, the ``[L, B, rows, cols]`` view of ``residuals`` where its
                residual is written (may be the memory its ``mats`` views: it is written
                when nothing reads them any more).
            states: per group, the state that holds its warm starts (where its new ones are
                stored).
            comm, ctx: as :meth:`reduce`'s.
            dense_out: ``[L, d]``, where the riders' residual is written (else a new tensor).
            averages: per group, ``[B, rows, cols]`` where its average is computed (its
                matrices at aligned places, laid out as :func:`aligned_matrices` lays them
                out), or ``None`` for a new buffer.
        """
        workers, world = comm.local_workers, comm.world_size
        qts = {k: self._warm_starts(names[k], k, states[k], ctx, mats[k].device) for k in keys}
        counts = [len(names[k]) for k in keys]
        dense_count = sum(t[0].numel() for t in riders)
        dense_rest = dense_average = None
        owns: list[torch.Tensor] = []
        ps: dict[tuple[int, ...], torch.Tensor] = {}  # [B, rows, r] per group
        for iteration in range(self.power_iterations):
            # Round 1: P = M Q, summed. Dense tensors ride along in the first round's buffer.
            # Both products are computed transposed, P^T = Q^T M^T and Q^T = P^T M, and the
            # factors travel transposed ([r, rows] and [r, cols] per matrix): the same
            # arithmetic, but a GEMM whose *left* operand is the thin r-row factor streams M
            # once at memory speed, while M Q with r columns runs several times slower on CPU
            # BLAS.
            pt_parts = _products([(qts[k], mats[k].transpose(-1, -2)) for k in keys])
            ride = riders if iteration == 0 else []
            flat = flatten_workers(ride + pt_parts, workers)
            lead = sum(t[0].numel() for t in ride)
            if ride:
                # What error feedback keeps of a tensor sent dense, ``tensor - tensor`` (zero,
                # NaN where not finite), for all of them in one op, before the all-reduce
                # (which may sum in place).
                dense_rest = torch.sub(flat[:, :lead], flat[:, :lead], out=dense_out)
            total = _mean(comm.all_reduce(flat), world)
            if ride:
                dense_average = total[:dense_count]
            sizes = [p[0].numel() for p in pt_parts]
            # P^T travels as [B, r, rows]; orthogonalised matrix by matrix into [B, rows, r],
            # all groups' rescaling exponents computed together (bit for bit what each
            # matrix alone would use).
            # The rescaling of every matrix (see gradzip.ops.lowrank.orthogonalize) applied
            # to the whole region of P^T factors at once: a power of two per matrix,
            # gathered per entry, elementwise the same product as matrix by matrix.
            if keys:
                region = total[lead:]
                tops, index = _tops(region, sizes, counts)
                scaled = region * torch.exp2(rescale_exponents(tops)).index_select(0, index)
                ps = dict(zip(keys, orthonormal_many(
                    [piece.reshape(len(names[k]), k[2], k[0])
                     for k, piece in zip(keys, scaled.split(sizes), strict=True)]), strict=True))
            if not keys:
                # No matrix: the dense tensors' message was the exchange (a second, empty
                # all-reduce would cost a round trip and carry nothing).
                break
            # Round 2: Q = M^T P, summed.
            qt_local = dict(zip(keys, _products([(ps[k].transpose(-1, -2), mats[k])
                                                  for k in keys]), strict=True))
            flat_q = flatten_workers([qt_local[k] for k in keys], workers)
            if iteration == self.power_iterations - 1 and keys:
                owns = _settle(keys, ps, qt_local, mats, residuals, rests, workers, flat_q)
            total_q = _mean(comm.all_reduce(flat_q), world)
            sizes_q = [qt_local[k][0].numel() for k in keys]
            # Copied out of the message to aligned places, all groups in one allocation and
            # one multi-tensor copy where the device takes them in one launch.
            placed = aligned_matrices((), [(len(names[k]), k[2], k[1]) for k in keys],
                                      dtype=total_q.dtype, device=total_q.device)
            copy_many(placed, [piece.reshape(into.shape) for piece, into
                               in zip(split_flat(total_q, sizes_q), placed, strict=True)])
            qts = dict(zip(keys, placed, strict=True))
        if not keys:
            return _Exchanged(dense_rest, dense_average, [], [])
        new_qs: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}  # per state: (it, new q)
        # Warm starts are stored per name as contiguous [cols, r] slices of one tamed
        # [B, cols, r] block per group (the layout of a checkpoint's), each at an aligned
        # place, the groups one after another in one buffer for the call: the next step
        # takes each group as it is, and a rollback of the state is one ``where`` for the
        # call (see gradzip.engine.deferred). The taming scales of all groups are computed
        # together.
        shifts = _tame_shifts(_tops(total_q, sizes_q, counts)[0]).split(counts)
        first = qts[keys[0]]
        blocks = aligned_matrices((), [(len(names[k]), k[1], k[2]) for k in keys],
                                  dtype=first.dtype, device=first.device, zero=True)
        approxes = [a[0] for a in _products([(ps[k], qts[k].unsqueeze(0)) for k in keys],
                                            [None if into is None else into.unsqueeze(0)
                                             for into in (averages or [None] * len(keys))])]
        for k, shift, block in zip(keys, shifts, blocks, strict=True):
            tamed = torch.mul(qts[k].transpose(-1, -2), shift.reshape(-1, 1, 1), out=block)
            # One unbind per group (views made in one call), not an index per matrix.
            state = states[k]
            if id(state) not in new_qs:
                new_qs[id(state)] = (state, dict(state["q"]))
            new_qs[id(state)][1].update(zip(names[k], tamed.unbind(0), strict=True))
        for state, new_q in new_qs.values():
            state["q"] = new_q
        return _Exchanged(dense_rest, dense_average, owns, approxes)


def reduce_together(
    parts: Sequence[tuple[Compressor, Sequence[Job], dict[str, Any]]], comm: Collective,
    ctx: StepContext,
) -> None:
    """:meth:`PowerSGD.reduce` of every part's jobs, each part with its own configuration and
    state, in one exchange: two all-reduces for all of them (a two-level controller's levels,
    PowerSGD at two ranks, take two instead of four; PowerSGD and ``none``, two instead of
    three). The first part is a PowerSGD, and every other must
    :meth:`~PowerSGD.shares_exchange` with it; the first's power iterations, warm start and
    seed serve all. Each group of matrices is one part's (its key carries the part), so
    every matrix's products, warm start and residual are what its part's own ``reduce``
    gives; the messages hold every part's factors, the parts' dense tensors first (all of a
    ``none`` part's)."""
    lead = parts[0][0]
    assert isinstance(lead, PowerSGD), lead
    dense: list[Job] = []
    groups: dict[tuple[int, ...], list[Job]] = {}
    states: dict[tuple[int, ...], dict[str, Any]] = {}
    for at, (compressor, jobs, state) in enumerate(parts):
        assert at == 0 or lead.shares_exchange(compressor), compressor
        if not isinstance(compressor, PowerSGD):  # none: every tensor travels dense
            dense += jobs
            continue
        some_dense, keys, some = compressor._groups(jobs)
        dense += some_dense
        for k in keys:
            groups[(*k, at)] = some[k]
            states[(*k, at)] = state
    keys = sorted(groups)  # identical order on every worker
    # Each group of same-shape matrices as one [L, B, rows, cols] batch (a view where the
    # gradients already lie at aligned places one after another, else one copy): every
    # product below is one batched GEMM per group, whatever the number of tensors. Every
    # matrix a product reads or writes starts at an aligned place (see
    # gradzip.ops.lowrank.aligned_matrices): the BLAS rounds with the alignment, and a
    # matrix's bits must not depend on the tensors it shares a call with (DDP's buckets,
    # a resume, a process group against the simulator group them differently).
    mats = {k: stack_matrices([j.tensor for j in groups[k]], k[0], k[1]) for k in keys}
    names = {k: [j.name for j in groups[k]] for k in keys}
    # All residuals of the call in one buffer: one finiteness test for all of them.
    first = next((jobs[0] for _, jobs, _ in parts if jobs), None)
    device = first.tensor.device if first is not None else torch.device("cpu")
    residuals = torch.empty(comm.local_workers, sum(j.numel for k in keys for j in groups[k]),
                            dtype=torch.float32, device=device)
    rests = _group_views(residuals, [(len(groups[k]), k[0], k[1]) for k in keys])
    out = lead._exchange(keys, names, mats, [j.tensor for j in dense], residuals, rests,
                         states, comm, ctx)
    if dense:
        for job, rest in zip(dense, job_rows(dense, out.dense_rest), strict=True):
            job.keep(rest)
        give_averages(dense, out.dense_average)
        for job in dense:
            job.decoded = job.tensor
    for k, own, rest, approx in zip(keys, out.owns, rests, out.approxes, strict=True):
        # One unbind per group (views made in one call), not an index per matrix.
        for b, (job, mine) in enumerate(zip(groups[k], approx.unbind(0), strict=True)):
            job.decoded = own[:, b].reshape(job.tensor.shape)
            job.keep(rest[:, b].reshape(job.tensor.shape))
            job.averaged = mine.reshape(job.shape)


def row_plan(
    parts: Sequence[Compressor], part_of: Sequence[int], names: Sequence[str],
    sizes: Sequence[int], shapes: Sequence[torch.Size],
) -> SegmentPlan:
    """The segment plan of a call whose tensor ``i`` is reduced by ``parts[part_of[i]]``,
    all parts in one exchange as :func:`reduce_together` makes it (one part: what
    :meth:`PowerSGD.reduce` makes). Each group of same-shape matrices of one part, its
    tensors in the engine's order, then the tensors sent dense, part by part. The groups
    whose matrices fill whole multiples of :data:`~gradzip.ops.lowrank.ALIGN_BYTES` come
    first, so that each of their matrices lies at an aligned place in the row and is read,
    and averaged, in place; the others follow (each read from one copy). Only their places
    in the row differ from :func:`reduce_together`: the messages keep its order (groups by
    ``(rows, cols, rank, part)``, the dense tensors first, part by part)."""
    dense: list[int] = []
    groups: dict[tuple[int, int, int, int], list[int]] = {}
    for i, shape in enumerate(shapes):
        part = parts[part_of[i]]
        key = part._group_key(torch.Size(shape)) if isinstance(part, PowerSGD) else None
        if key is None:
            dense.append(i)
        else:
            groups.setdefault((*key, part_of[i]), []).append(i)
    dense.sort(key=lambda i: part_of[i])  # stable: each part's in the engine's order
    keys = tuple(sorted(groups))
    quantum = ALIGN_BYTES // 4  # fp32 entries
    placed = sorted(keys, key=lambda k: (k[0] * k[1]) % quantum != 0)  # stable
    starts, at = {}, 0
    for k in placed:
        starts[k] = at
        at += len(groups[k]) * k[0] * k[1]
    order = tuple(i for k in placed for i in groups[k]) + tuple(dense)
    return SegmentPlan(order, _RowPlan(
        dense=sum(sizes[i] for i in dense), matrices=at, keys=keys,
        names=tuple(tuple(names[i] for i in groups[k]) for k in keys),
        starts=tuple(starts[k] for k in keys)))


def reduce_row(
    lead: PowerSGD, flat: torch.Tensor, rows: _RowPlan, states: Sequence[dict[str, Any]],
    comm: Collective, ctx: StepContext,
) -> torch.Tensor:
    """The exchange of a row laid out by :func:`row_plan` (``flat``, ``[1, N]``, overwritten
    with the residuals), ``states[p]`` the state of part ``p``, ``lead`` the first part (whose
    power iterations, warm start and seed serve all, as in :func:`reduce_together`): the
    ``[N]`` average in the row's order, a new tensor."""
    average = torch.empty(flat.shape[1], dtype=torch.float32, device=flat.device)
    # A group whose matrices lie at aligned places in the row is read in place, and its
    # average computed in place too where the same region of ``average`` is aligned (it
    # is laid out as the row, from an aligned start: it is when the row's is). Any other
    # group is read from one copy, and its average copied in.
    mats, rests, into = {}, [], []
    for k, names, start in zip(rows.keys, rows.names, rows.starts, strict=True):
        size = len(names) * k[0] * k[1]
        region = flat[:, start:start + size]
        mats[k] = stack_region(region, len(names), k[0], k[1])
        rests.append(region.view(flat.shape[0], len(names), k[0], k[1]))
        there = average[start:start + size].view(len(names), k[0], k[1])
        in_place = (mats[k].data_ptr() == region.data_ptr()
                    and not there.data_ptr() % ALIGN_BYTES)
        into.append(there if in_place else None)
    end = rows.matrices + rows.dense
    lead_dense = [flat[:, rows.matrices:end]] if rows.dense else []
    # The riders' residual is written over them once the message holds them.
    out = lead._exchange(list(rows.keys), dict(zip(rows.keys, rows.names, strict=True)), mats,
                         lead_dense, flat[:, :rows.matrices], rests,
                         {k: states[k[3]] for k in rows.keys}, comm, ctx,
                         dense_out=lead_dense[0] if lead_dense else None, averages=into)
    if rows.dense:
        average[rows.matrices:end].copy_(out.dense_average)
    for approx, placed, start in zip(out.approxes, into, rows.starts, strict=True):
        if placed is None:
            average[start:start + approx.numel()].view(approx.shape).copy_(approx)
    return average


@dataclass(frozen=True)
class _RowPlan:
    """PowerSGD's segment plan's data: the groups ``(rows, cols, rank, part)`` in
    :func:`reduce_together`'s order, each group's tensors and its first entry in the row;
    the entries of all the groups (the row's first part) and of the tensors sent dense
    (which follow)."""

    dense: int
    matrices: int
    keys: tuple[tuple[int, int, int, int], ...]
    names: tuple[tuple[str, ...], ...]
    starts: tuple[int, ...]


@dataclass
class _Exchanged:
    """What :meth:`PowerSGD._exchange` leaves for its caller to hand out: the tensors sent
    dense (their residual ``[L, d]`` and average ``[d]``, ``None`` without them), and per
    group each worker's own decoded message ``[L, B, rows, cols]`` and the average
    ``[B, rows, cols]`` (the residuals are where the caller's ``rests`` put them)."""

    dense_rest: torch.Tensor | None
    dense_average: torch.Tensor | None
    owns: list[torch.Tensor]
    approxes: list[torch.Tensor]


def _settle(
    keys: list[tuple[int, ...]], ps: dict[tuple[int, ...], torch.Tensor],
    qt_local: dict[tuple[int, ...], torch.Tensor],
    mats: dict[tuple[int, ...], torch.Tensor], residuals: torch.Tensor,
    rests: list[torch.Tensor], workers: int, flat_q: torch.Tensor | None,
) -> list[torch.Tensor]:
    """Decode each worker's own message and its residual *before* the last all-reduce,
    and make a worker whose residual is not finite send NaN in its ``Q`` factor.

    A worker's decoded message ``P Q_w^T`` and residual ``M - P Q_w^T`` can overflow on
    that worker alone while the average stays finite; poisoning its ``Q`` makes the summed
    ``Q`` (hence the average, tested by the engine on every worker alike) non-finite, so
    every worker applies the non-finite policy instead of one keeping a poisoned residual.

    Args:
        keys: the groups, in order.
        ps: ``P`` per group, ``[B, rows, r]``.
        qt_local: each worker's ``Q^T`` per group, ``[L, B, r, cols]``; poisoned in place.
        mats: the groups' matrices ``[L, B, rows, cols]``.
        residuals: ``[L, total]``, every group's residual (tested as one tensor).
        rests: per group, the ``[L, B, rows, cols]`` view of ``residuals`` where its
            ``M - P Q_w^T`` is written (it may be the memory the group's ``mats`` views).
        workers: ``L``.
        flat_q: the ``[L, total]`` message made of ``qt_local``'s tensors, if it is made
            already (then it is poisoned instead, with one op).

    Returns:
        Each group's decoded messages, ``[L, B, rows, cols]``.
    """
    owns = _products([(ps[k], qt_local[k]) for k in keys])  # [L, B, rows, cols] each
    # Bit for bit each job's ``tensor - decoded``. A group whose residual is written over its
    # matrices (the segment path's groups read in place) subtracts in place, all such groups
    # in one multi-tensor op where the device takes them in one launch (one row each: the
    # worker axis of one is dropped, as its stride differs between the two sides); any other
    # group, one subtraction into its residual.
    over, at = [], []
    for k, residual, own in zip(keys, rests, owns, strict=True):
        if _same_memory(residual, mats[k]):
            over.append(residual[0] if workers == 1 else residual)
            at.append(own[0] if workers == 1 else own)
        else:
            torch.sub(mats[k], own, out=residual)
    sub_many_(over, at)
    # On the device, no host synchronisation: NaN where a worker's residual is not finite.
    bad = ~finite_rows([residuals], workers)
    for target in [flat_q] if flat_q is not None else [qt_local[k] for k in keys]:
        target.masked_fill_(bad.reshape(workers, *([1] * (target.dim() - 1))), float("nan"))
    return owns


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` view the very same entries in the same places."""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


def _reduce_per_matrix(
    comp: PowerSGD, jobs: Sequence[Job], state: dict[str, Any], comm: Collective, ctx: StepContext
) -> None:
    """:meth:`PowerSGD.reduce` written matrix by matrix and worker by worker, each product
    on one matrix (a batch of one) whose operands and result are tensors of their own: the
    reference the batched implementation is tested against. Same messages, same buffer
    layout, same state and residual contract; slower (many more ops).
    """
    workers, world = comm.local_workers, comm.world_size
    dense, keys, groups = comp._groups(jobs)
    ordered = [(k, job) for k in keys for job in groups[k]]

    def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.bmm(a.unsqueeze(0), b.unsqueeze(0))[0]

    # Each worker's matrix a tensor of its own (a fresh allocation, hence aligned).
    mats = {job.name: [m.clone() for m in job.tensor.reshape(workers, k[0], k[1])]
            for k, job in ordered}
    qt = {}  # Q^T per matrix: [r, cols]
    for _, job in ordered:
        q = state["q"][job.name] if comp.warm_start else comp._fresh_q(job.name, job.shape, ctx.step)
        qt[job.name] = to_device(q, mats[job.name][0].device).clone().t()
    p: dict[str, torch.Tensor] = {}
    for iteration in range(comp.power_iterations):
        pt_parts = [torch.stack([product(qt[j.name], m.t()) for m in mats[j.name]])
                    for _, j in ordered]  # [L, r, rows] each
        riders = list(dense) if iteration == 0 else []
        total = comm.all_reduce(flatten_workers([j.tensor for j in riders] + pt_parts, workers))
        total = total.div_(world)
        pieces = split_flat(total, [j.numel for j in riders] + [t[0].numel() for t in pt_parts])
        for job, piece in zip(riders, pieces[: len(riders)], strict=True):
            job.averaged = piece.reshape(job.shape)
            job.decoded = job.tensor
        for (k, job), piece in zip(ordered, pieces[len(riders):], strict=True):
            p[job.name] = orthogonalize(piece.reshape(k[2], k[0]).t())  # [rows, r]
        if not ordered:
            break  # no matrix: the dense tensors' message was the exchange
        qt_local = {j.name: [product(p[j.name].t(), m) for m in mats[j.name]]
                    for _, j in ordered}  # [r, cols] per worker
        if iteration == comp.power_iterations - 1:
            finite = None
            for _, job in ordered:
                own = torch.stack([product(p[job.name], q) for q in qt_local[job.name]])
                job.decoded = own.reshape(job.tensor.shape)
                job.keep(job.tensor - job.decoded)
                ok = finite_rows([job.residual], workers)
                finite = ok if finite is None else finite & ok
            for _, job in ordered:
                assert finite is not None
                qt_local[job.name] = [torch.where(finite[w], q, float("nan"))
                                      for w, q in enumerate(qt_local[job.name])]
        parts = [torch.stack(qt_local[j.name]) for _, j in ordered]
        total_q = comm.all_reduce(flatten_workers(parts, workers)).div_(world)
        for (k, job), piece in zip(ordered, split_flat(total_q, [t[0].numel() for t in parts]),
                                   strict=True):
            qt[job.name] = piece.reshape(k[2], k[1]).clone()
    new_q = dict(state["q"])
    for _, job in ordered:
        job.averaged = product(p[job.name], qt[job.name]).reshape(job.shape)
        new_q[job.name] = _tame(qt[job.name].t().contiguous())
    state["q"] = new_q
