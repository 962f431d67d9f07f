"""PowerSGD: rank-r approximation by one step of subspace iteration, warm-started."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gradzip._validate import check_bool, check_int, check_real
from gradzip.comm.base import Collective
from gradzip.compressors.base import Compressor, Job, StepContext
from gradzip.ops.finite import finite_rows
from gradzip.ops.flat import flatten_workers, split_flat, to_device
from gradzip.ops.lowrank import orthogonalize
from gradzip.ops.random import generator_for

__all__ = ["PowerSGD"]


# Matrices of at most this many entries are stacked for batched matmuls (see ``reduce``).
_STACK_MAX = 1 << 16


def _each_worker(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a[x, y] @ b[w]`` for every ``w`` of ``b[L, y, z]``: ``[L, x, z]``, one 2-D GEMM each."""
    if b.shape[0] == 1:
        return torch.mm(a, b[0]).unsqueeze(0)
    return torch.stack([torch.mm(a, part) for part in b])


def _stack_batch(parts: list[torch.Tensor]) -> torch.Tensor:
    """``[L, ...]`` tensors stacked along a new batch axis 1 (no copy for a single one)."""
    return parts[0].unsqueeze(1) if len(parts) == 1 else torch.stack(parts, dim=1)


def _stack_workers(parts: list[torch.Tensor]) -> torch.Tensor:
    """Per-worker results stacked along a new worker axis 0 (no copy for a single worker)."""
    return parts[0].unsqueeze(0) if len(parts) == 1 else torch.stack(parts)


# A warm start whose largest entry exceeds this is scaled down by a power of two (see _tame).
_Q_LIMIT = 2.0**32


def _tame(q: torch.Tensor) -> torch.Tensor:
    """``q`` scaled by a power of two so that its largest entry is at most 1 when it exceeds
    :data:`_Q_LIMIT`; otherwise ``q`` times 1 (exact). Computed on ``q``'s device, without a
    host synchronisation.

    ``Q = M^T P`` carries the gradient's magnitude (only ``P`` is orthonormal), and the next
    step multiplies it by the next gradient: after one huge but finite gradient, every later
    product would overflow, and each step would be skipped forever. Only the column space of
    ``Q`` matters (``P = orthogonalize(M Q)``), and a power-of-two scale is exact, so this
    changes nothing else; ordinary warm starts never reach the limit and stay bit-identical.
    """
    if q.numel() == 0:
        return q
    top = q.abs().amax()
    huge = (top > _Q_LIMIT) & torch.isfinite(top)
    shift = torch.exp2(-torch.ceil(torch.log2(torch.where(huge, top, 1.0))))
    return q * shift


def _matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """Tensors are seen as ``[shape[0], prod(shape[1:])]`` (a conv kernel by output channel)."""
    return int(shape[0]), int(math.prod(shape[1:]))


@dataclass(frozen=True)
class PowerSGD(Compressor):
    """Rank-``matrix_rank`` compression by power iteration with a warm start.

    For each matrix ``M`` (a tensor reshaped to ``[rows, cols]``): ``P = M Q`` is all-reduced and
    orthogonalised, then ``Q = M^T P`` is all-reduced; the average is ``P Q^T / W``. ``Q`` is
    kept for the next step (warm start), so one iteration per step converges over steps.
    Matrices of the same shape are processed together with batched matmuls, and all ``P``
    factors (with the tensors sent dense) travel in one flat buffer, all ``Q`` factors in a
    second one: two all-reduces per step, however many tensors.

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
        _, cols = _matrix_shape(shape)
        gen = generator_for("powersgd-q", self.seed, name, step)
        return torch.randn(cols, self.matrix_rank_for(shape), generator=gen)

    def init_state(self, shapes: Mapping[str, torch.Size]) -> dict[str, Any]:
        return {
            "q": {
                name: self._fresh_q(name, torch.Size(shape), -1)
                for name, shape in shapes.items()
                if self.matrix_rank_for(torch.Size(shape))
            }
        }

    # -- the algorithm --------------------------------------------------------------------
    def reduce(
        self, jobs: Sequence[Job], state: dict[str, Any], comm: Collective, ctx: StepContext
    ) -> None:
        workers, world = comm.local_workers, comm.world_size
        dense = []
        groups: dict[tuple[int, int, int], list[Job]] = {}
        for job in jobs:
            shape = job.shape
            r = self.matrix_rank_for(shape)
            if r:
                groups.setdefault((*_matrix_shape(shape), r), []).append(job)
            else:
                dense.append(job)
        keys = sorted(groups)  # identical order on every worker
        # Views of the gradients; a strided one is copied once, so that the matmuls below see
        # the same layout (hence round the same way) whatever the caller's storage.
        mats = {
            key: [j.tensor.reshape(workers, key[0], key[1]).contiguous() for j in groups[key]]
            for key in keys
        }
        # Small matrices of one shape are stacked (one copy) for batched matmuls; large ones
        # are multiplied one by one, which reads each gradient in place instead of copying it.
        stacked = {
            key: torch.stack(mats[key], dim=1)  # [L, B, rows, cols]
            for key in keys
            if len(mats[key]) > 1 and key[0] * key[1] <= _STACK_MAX
        }

        # Both products are computed transposed, P^T = Q^T M^T and Q^T = P^T M, and the factors
        # travel transposed ([r, rows] and [r, cols] per matrix). It is the same arithmetic,
        # but a GEMM whose *left* operand is the thin r-row factor streams M once at memory
        # speed, while M Q with r columns runs several times slower on CPU BLAS; and the
        # results are contiguous as they are sent. Per worker 2-D products (never a broadcast
        # matmul, which folds back to M Q) keep each worker's result independent of how many
        # workers the process holds.
        def left(key: tuple[int, int, int], qt: torch.Tensor) -> torch.Tensor:
            """``(M Q)^T`` for every matrix of the group: ``[L, B, r, rows]``."""
            if key in stacked:
                return torch.matmul(qt, stacked[key].transpose(-1, -2))
            return _stack_batch(
                [_each_worker(qt[b], m.transpose(-1, -2)) for b, m in enumerate(mats[key])]
            )

        def right(key: tuple[int, int, int], pt: torch.Tensor) -> torch.Tensor:
            """``(M^T P)^T`` for every matrix of the group: ``[L, B, r, cols]``."""
            if key in stacked:
                return torch.matmul(pt, stacked[key])
            return _stack_batch([_each_worker(pt[b], m) for b, m in enumerate(mats[key])])

        qts = {}  # Q^T per group: [B, r, cols]
        for key in keys:
            if self.warm_start:
                stored = [state["q"][j.name] for j in groups[key]]
            else:
                stored = [self._fresh_q(j.name, j.shape, ctx.step) for j in groups[key]]
            device = mats[key][0].device
            batch = stored[0].unsqueeze(0) if len(stored) == 1 else torch.stack(stored)
            qts[key] = to_device(batch.transpose(-1, -2), device)
        qt_local: dict[tuple[int, int, int], torch.Tensor] = {}
        ps: dict[tuple[int, int, int], torch.Tensor] = {}
        for iteration in range(self.power_iterations):
            # Round 1: P = M Q, summed. Dense tensors ride along in the first round's buffer.
            pt_parts = [left(k, qts[k]) for k in keys]  # [L, B, r, rows]
            riders = list(dense) if iteration == 0 else []
            flat = flatten_workers([j.tensor for j in riders] + pt_parts, workers)
            total = comm.all_reduce(flat).div_(world)  # a fresh tensor: divide in place
            sizes = [j.numel for j in riders] + [p[0].numel() for p in pt_parts]
            pieces = split_flat(total, sizes)
            for job, piece in zip(riders, pieces[: len(riders)], strict=True):
                job.averaged = piece.reshape(job.shape)
                job.decoded = job.tensor
            for k, piece in zip(keys, pieces[len(riders):], strict=True):
                pt = piece.reshape(len(groups[k]), k[2], k[0])
                ps[k] = orthogonalize(pt.transpose(-1, -2))  # [B, rows, r]
            # Round 2: Q = M^T P, summed.
            qt_local = {k: right(k, ps[k].transpose(-1, -2)) for k in keys}  # [L, B, r, cols]
            if iteration == self.power_iterations - 1:
                self._settle_residuals(keys, groups, ps, qt_local, workers)
            flat_q = flatten_workers([qt_local[k] for k in keys], workers)
            total_q = comm.all_reduce(flat_q).div_(world)
            sizes = [qt_local[k][0].numel() for k in keys]
            for k, piece in zip(keys, split_flat(total_q, sizes), strict=True):
                qts[k] = piece.reshape(len(groups[k]), k[2], k[1])
        new_q = dict(state["q"])
        for k in keys:
            approx = torch.bmm(ps[k], qts[k])  # [B, rows, cols]
            for b, job in enumerate(groups[k]):
                job.averaged = approx[b].reshape(job.shape)
                new_q[job.name] = _tame(qts[k][b].t().contiguous())  # stored as [cols, r]
        state["q"] = new_q

    @staticmethod
    def _settle_residuals(
        keys: list[tuple[int, int, int]],
        groups: dict[tuple[int, int, int], list[Job]],
        ps: dict[tuple[int, int, int], torch.Tensor],
        qt_local: dict[tuple[int, int, int], torch.Tensor],
        workers: int,
    ) -> None:
        """Decode each worker's own message and its residual *before* the last all-reduce,
        and make a worker whose residual is not finite send NaN in its ``Q`` factor.

        A worker's decoded message ``P Q_w^T`` and residual ``M - P Q_w^T`` can overflow on
        that worker alone while the average stays finite; poisoning its ``Q`` makes the summed
        ``Q`` (hence the average, tested by the engine on every worker alike) non-finite, so
        every worker applies the non-finite policy instead of one keeping a poisoned residual.
        """
        finite = torch.ones(workers, dtype=torch.bool, device=ps[keys[0]].device if keys else None)
        for k in keys:
            own = _stack_workers([torch.bmm(ps[k], qt_local[k][w]) for w in range(workers)])
            for b, job in enumerate(groups[k]):
                job.decoded = own[:, b].reshape(job.tensor.shape)
            finite &= finite_rows([j.leftover() for j in groups[k]], workers)
        # On the device, no host synchronisation: NaN where a worker's residual is not finite.
        for k in keys:
            mask = finite.reshape(workers, *([1] * (qt_local[k].dim() - 1)))
            qt_local[k].copy_(torch.where(mask, qt_local[k], float("nan")))
