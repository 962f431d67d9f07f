"""QSGD: unbiased stochastic quantisation to a few levels, bit-packed."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from gradzip._validate import check_choice, check_int
from gradzip.comm.base import Collective
from gradzip.compressors.base import Compressor, Job, StepContext, dense_reduce
from gradzip.compressors.sharded_codes import (
    EXCHANGES,
    ExchangeStateCheck,
    exchange_report,
    init_exchange_state,
    sharded_reduce,
    split_by_form,
)
from gradzip.ops import jit
from gradzip.ops.bits import code_width, pack_bits, packed_size, unpack_bits
from gradzip.ops.branches import cpu_form
from gradzip.ops.checks import check_range
from gradzip.ops.flat import reinterpret, to_device
from gradzip.ops.random import generator_for

__all__ = ["QSGD"]

# Entries per step of the decoding loop: the chunk of the sum (1 MiB) and every row's codes
# for it stay in cache while all rows are added.
_CHUNK = 1 << 18


@dataclass(frozen=True)
class QSGD(ExchangeStateCheck, Compressor):
    """Quantise each entry to ``norm * sign * l / levels`` with ``l`` in ``0..levels``, rounding
    up or down at random so the result is unbiased; one fp32 norm per bucket.

    Codes ``sign * l + levels`` take ``ceil(log2(2 * levels + 1))`` bits each; the codes of
    all tensors reduced in one call are packed densely as one stream, after their norms.
    Per-worker randomness comes from generators seeded by ``(seed, step, name, rank)``.

    Quantised values cannot be summed without decoding, so a tensor travels in one of three
    forms (:func:`~gradzip.compressors.sharded_codes.choose_exchange`, from its size, the world size
    and ``exchange``): every worker's message all-gathered; the sharded exchange
    (:mod:`gradzip.compressors.sharded_codes`: each part of ``ceil(n / W)`` entries quantised with
    its own norms, sent to its owner, averaged there, quantised again with fresh rounding
    noise (unbiased, no owner residual), and all-gathered; the bytes per worker do not grow
    with ``W``); or dense,
    where an fp32 all-reduce is cheaper than both.

    Args:
        levels: quantisation levels per sign, in [1, 127].
        bucket_size: entries sharing one norm (0: the whole tensor, or the whole part in
            the sharded exchange).
        seed: seed of the rounding noise.
        exchange: ``"auto"`` (the form with the fewest wire bytes), ``"allgather"`` or
            ``"sharded"``.

    References:
        Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient Quantization and
        Encoding", NeurIPS 2017.
    """

    levels: int = 8
    bucket_size: int = 0
    seed: int = 0
    exchange: str = "auto"
    spec_name: ClassVar[str] = "qsgd"
    device_decisions: ClassVar[bool] = True
    biased: ClassVar[bool] = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "levels", check_int("levels", self.levels, minimum=1, maximum=127))
        object.__setattr__(self, "bucket_size", check_int("bucket_size", self.bucket_size, minimum=0))
        object.__setattr__(self, "seed", check_int("seed", self.seed, minimum=0))
        object.__setattr__(self, "exchange", check_choice("exchange", self.exchange, EXCHANGES))

    def init_group_state(
        self, shapes: Mapping[str, torch.Size], world_size: int, local_workers: int
    ) -> dict[str, Any]:
        """Each tensor's form (no owner residuals: QSGD is unbiased)."""
        # No owner residual: see sharded_reduce (an unbiased code, error possibly above the
        # signal, which error feedback would let grow).
        return init_exchange_state(self, self.exchange, shapes, world_size, local_workers,
                                   owner_feedback=False)

    def report(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Tensors per exchange form (when the state was made for a group)."""
        found = exchange_report(state)
        return {"exchange": found} if found else {}

    @property
    def bits(self) -> int:
        return code_width(2 * self.levels)

    def _layout(self, numel: int) -> tuple[int, int]:
        """(buckets, bucket length) for a tensor of ``numel`` entries (no bucket for an empty
        tensor: its message is empty)."""
        size = max(1, numel if self.bucket_size == 0 else min(self.bucket_size, numel))
        return -(-numel // size), size

    def message_bytes(self, *numels: int) -> int:
        """Bytes of one worker's message for tensors of these sizes reduced in one call: every
        tensor's norms, then all codes packed as one stream."""
        norms = sum(4 * self._layout(n)[0] for n in numels)
        return norms + packed_size(sum(numels), self.bits)

    def _encode(
        self, x: torch.Tensor, names: Sequence[str], ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x[G, L, n]`` (``G`` tensors of ``n`` entries, named ``names``) -> (norms
        ``[G, L, buckets]`` fp32, codes ``[G, L, n]`` uint8). Every entry sees the operations
        it would see in a tensor of its own; the rounding noise of each tensor and rank comes
        from its own keyed generator."""
        group, workers, numel = x.shape
        buckets, size = self._layout(numel)
        noise = torch.stack([
            torch.rand(buckets, size, generator=generator_for("qsgd", self.seed, ctx.step, name, r))
            for name in names for r in ctx.ranks
        ]).reshape(group, workers, buckets * size)
        # Page-locked and queued: a plain ``.to`` of host memory would make the host wait.
        return self._quantise(x, to_device(noise, x.device))

    def _quantise(self, x: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x[G, R, n]`` with uniform ``noise[G, R, buckets * size]`` -> (norms
        ``[G, R, buckets]``, codes ``[G, R, n]``): each bucket scaled by its norm, each entry
        rounded up where its noise falls below its fraction."""
        group, workers, numel = x.shape
        buckets, size = self._layout(numel)
        padded = torch.nn.functional.pad(x, (0, buckets * size - numel))
        padded = padded.reshape(group, workers, buckets, size)
        norms = padded.norm(dim=3)
        scaled = padded.abs() / torch.where(norms > 0, norms, 1.0).unsqueeze(3) * self.levels
        lower = scaled.floor()
        noise = noise.reshape(group, workers, buckets, size)
        level = lower + (noise < (scaled - lower)).to(x.dtype)
        # A non-finite input gives NaN levels; they become 0 so every code stays in range
        # (the engine discards such a call's result, but the message must still decode).
        level = level.nan_to_num_(0.0).clamp_(0, self.levels)
        level = level.reshape(group, workers, -1)[..., :numel]
        codes = (torch.sign(x) * level + self.levels).to(torch.uint8)
        return norms, codes

    # -- the code of one part, for the sharded exchange (gradzip.compressors.sharded_codes) ------
    def part_bytes(self, count: int) -> int:
        """Bytes of the message of ``count`` entries: its buckets' norms, then its codes."""
        return 4 * self._layout(count)[0] + packed_size(count, self.bits)

    def encode_parts(self, x: torch.Tensor, draws: torch.Tensor | None) -> torch.Tensor:
        """``x[R, m]`` -> messages ``[R, part_bytes(m)]``, each row with its own norms."""
        assert draws is not None, "QSGD rounds at random: it needs draws"
        buckets, size = self._layout(x.shape[1])
        noise = torch.nn.functional.pad(draws, (0, buckets * size - x.shape[1]))
        norms, codes = self._quantise(x[None], noise[None])
        # Codes are clamped to [0, 2 * levels] by _quantise: no range test (a host sync).
        return torch.cat([norms[0].contiguous().view(torch.uint8),
                          pack_bits(codes[0], self.bits, checked=False)], dim=1)

    def decode_parts(self, messages: torch.Tensor, count: int) -> torch.Tensor:
        """Messages ``[R, part_bytes(count)]`` -> values ``[R, count]``."""
        head = 4 * self._layout(count)[0]
        codes = unpack_bits(messages[:, head:], self.bits, count)
        # Asserted on the device: a host read of the codes would stall a CUDA stream per call.
        check_range(codes, 2 * self.levels, "message codes")
        return self._decode(reinterpret(messages[:, :head], torch.float32), codes, count)

    def part_draws(self, key: tuple[Any, ...], count: int, device: torch.device) -> torch.Tensor:
        """``count`` uniform draws keyed by ``(seed, *key)`` (never the global generator)."""
        noise = torch.rand(count, generator=generator_for("qsgd", self.seed, *key))
        return to_device(noise, device)

    def _decode(self, norms: torch.Tensor, codes: torch.Tensor, numel: int) -> torch.Tensor:
        """(norms ``[..., R, buckets]``, codes ``[..., R, n]``) -> values ``[..., R, n]``."""
        lead = codes.shape[:-1]
        buckets, size = self._layout(numel)
        level = codes.to(torch.float32) - self.levels
        level = torch.nn.functional.pad(level, (0, buckets * size - numel))
        values = level.reshape(*lead, buckets, size) * (norms / self.levels).unsqueeze(-1)
        return values.reshape(*lead, -1)[..., :numel]

    def _decode_sum(
        self, norms: torch.Tensor, codes: torch.Tensor, numel: int, divisor: int = 1
    ) -> torch.Tensor:
        """The sum over rows of :meth:`_decode`, divided by ``divisor``, without a float tensor
        per row: the sum of ``codes * norm / levels`` accumulated row by row in rank order (the
        same on every worker), minus the sum of the norms (each code carries an offset of
        ``levels``), then the division.

        On the CPU, with one bucket (or buckets of at least ``_CHUNK`` entries), this runs
        chunk by chunk, every row's pass over a chunk while it is in cache; each entry sees the same
        operations in the same order as in the whole-tensor form, so the result is the same.
        """
        rows = codes.shape[0]
        buckets, size = self._layout(numel)
        steps = norms / self.levels  # [R, buckets]
        offsets = norms.sum(dim=0)  # [buckets]
        # On the CPU only: elsewhere the whole-tensor form below is fewer kernel launches.
        if cpu_form(codes.device) and (size >= _CHUNK or buckets == 1):
            total = torch.empty(numel, dtype=torch.float32, device=codes.device)
            for b in range(buckets):
                for start in range(b * size, min(numel, (b + 1) * size), _CHUNK):
                    stop = min(numel, (b + 1) * size, start + _CHUNK)
                    out = total[start:stop].zero_()
                    for row in range(rows):
                        out.addcmul_(codes[row, start:stop], steps[row, b])
                    out.sub_(offsets[b]).div_(divisor)
            return total
        codes = torch.nn.functional.pad(codes, (0, buckets * size - numel))
        codes = codes.reshape(rows, buckets, size)
        total = torch.zeros(buckets, size, dtype=torch.float32, device=codes.device)
        for row in range(rows):
            total.addcmul_(codes[row], steps[row].unsqueeze(1))
        total.sub_(offsets.unsqueeze(1)).div_(divisor)
        return total.reshape(-1)[:numel]

    def reduce(
        self, jobs: Sequence[Job], state: dict[str, Any], comm: Collective, ctx: StepContext
    ) -> None:
        if not jobs:
            return
        # Every rank splits alike: a tensor's form depends on its size and the world size.
        forms = split_by_form(jobs, self, self.exchange, comm.world_size)
        dense_reduce(forms["dense"], comm)
        self._reduce_gathered(forms["allgather"], comm, ctx)
        sharded_reduce(forms["sharded"], state, comm, ctx, self, "sharded", owner_feedback=False)

    def _reduce_gathered(self, jobs: Sequence[Job], comm: Collective, ctx: StepContext) -> None:
        """Every worker's message of ``jobs`` all-gathered, each decoded and averaged."""
        if not jobs:
            return
        workers = comm.local_workers
        # Tensors of one size are encoded together: the work grows with the number of
        # distinct sizes, not of tensors.
        groups = _by_size(jobs)
        norm_parts: list[torch.Tensor] = [torch.empty(0)] * len(jobs)
        code_parts: list[torch.Tensor] = [torch.empty(0)] * len(jobs)
        for numel, members in groups.items():
            x = torch.stack([jobs[i].tensor.reshape(workers, numel) for i in members])
            norms, codes = self._encode(x, [jobs[i].name for i in members], ctx)
            decoded = self._decode(norms, codes, numel)
            for g, i in enumerate(members):
                jobs[i].decoded = decoded[g].reshape(jobs[i].tensor.shape)
                norm_parts[i] = norms[g].contiguous().view(torch.uint8)
                code_parts[i] = codes[g]
        # One message per call: every tensor's norms, then all codes as one packed stream.
        total = sum(job.numel for job in jobs)
        # Codes are clamped to [0, 2 * levels] by _encode: no range test (a host sync).
        packed = pack_bits(torch.cat(code_parts, dim=1), self.bits, checked=False)
        gathered = comm.all_gather(torch.cat([*norm_parts, packed], dim=1))  # [W, bytes] uint8
        # Every tensor's norms reinterpreted at once, then split (views).
        counts = [self._layout(job.numel)[0] for job in jobs]
        offset = 4 * sum(counts)
        all_norms = list(torch.split(reinterpret(gathered[:, :offset], torch.float32), counts, dim=1))
        if total and cpu_form(gathered.device) and 2 <= self.bits <= 7 and _jit_usable():
            self._average_compiled(jobs, all_norms, gathered[:, offset:], comm.world_size)
            return
        codes = unpack_bits(gathered[:, offset:], self.bits, total)
        # Asserted on the device: a host read of the codes would stall a CUDA stream per call.
        check_range(codes, 2 * self.levels, "message codes")
        starts = [0]
        for job in jobs:
            starts.append(starts[-1] + job.numel)
        for numel, members in groups.items():
            if cpu_form(codes.device):  # the CPU's chunked sum, tensor by tensor
                for i in members:
                    mine = codes[:, starts[i] : starts[i + 1]]
                    averaged = self._decode_sum(all_norms[i], mine, numel, comm.world_size)
                    jobs[i].averaged = averaged.reshape(jobs[i].shape)
                continue
            mine = torch.stack([codes[:, starts[i] : starts[i + 1]] for i in members])
            totals = self._decode_sums(torch.stack([all_norms[i] for i in members]), mine, numel,
                                       comm.world_size)
            for g, i in enumerate(members):
                jobs[i].averaged = totals[g].reshape(jobs[i].shape)

    def _decode_sums(
        self, norms: torch.Tensor, codes: torch.Tensor, numel: int, divisor: int
    ) -> torch.Tensor:
        """:meth:`_decode_sum`'s whole-tensor form for ``G`` tensors of one size at once:
        (norms ``[G, R, buckets]``, codes ``[G, R, n]``) -> ``[G, n]``, each the bits
        :meth:`_decode_sum` gives for its tensor (every entry sees the same operations)."""
        group, rows = codes.shape[:2]
        buckets, size = self._layout(numel)
        steps = norms / self.levels  # [G, R, buckets]
        offsets = norms.sum(dim=1)  # [G, buckets]
        codes = torch.nn.functional.pad(codes, (0, buckets * size - numel))
        codes = codes.reshape(group, rows, buckets, size)
        total = torch.zeros(group, buckets, size, dtype=torch.float32, device=codes.device)
        for row in range(rows):
            total.addcmul_(codes[:, row], steps[:, row].unsqueeze(2))
        total.sub_(offsets.unsqueeze(2)).div_(divisor)
        return total.reshape(group, -1)[:, :numel]

    def _average_compiled(
        self, jobs: Sequence[Job], all_norms: list[torch.Tensor], packed: torch.Tensor, world_size: int
    ) -> None:
        """The end of :meth:`reduce` through the compiled kernel: each tensor's average straight
        from the packed codes (no tensor of codes), the same bits as :meth:`_decode_sum`."""
        need = packed_size(sum(job.numel for job in jobs), self.bits)
        if packed.shape[1] < need:  # as unpack_bits refuses a truncated message
            raise ValueError(
                f"`packed` must hold at least {need} bytes for "
                f"{sum(job.numel for job in jobs)} codes of {self.bits} bits, got {packed.shape[1]}"
            )
        stream = packed.numpy()
        results, top, start = [], 0, 0
        for job, norms in zip(jobs, all_norms, strict=True):
            if job.numel == 0:  # the kernel wants at least one entry; an empty average
                results.append(np.zeros(0, dtype=np.float32))
                continue
            _, size = self._layout(job.numel)
            # The steps and offsets exactly as _decode_sum computes them.
            steps = (norms / self.levels).numpy()
            offsets = norms.sum(dim=0).numpy()
            out, job_top = jit.qsgd_sum(
                stream, self.bits, start, job.numel, size, steps, offsets, world_size
            )
            results.append(out)
            top = max(top, job_top)
            start += job.numel
        if top > 2 * self.levels:
            raise ValueError(f"message codes must lie in [0, {2 * self.levels}], got {top}")
        for job, out in zip(jobs, results, strict=True):
            job.averaged = torch.from_numpy(out).reshape(job.shape)


def _by_size(jobs: Sequence[Job]) -> dict[int, list[int]]:
    """``numel -> positions of the jobs of that size``, in order of first appearance."""
    groups: dict[int, list[int]] = {}
    for i, job in enumerate(jobs):
        groups.setdefault(job.numel, []).append(i)
    return groups


@functools.cache
def _jit_checked() -> bool:
    """Whether the compiled decoder gives :meth:`QSGD._decode_sum`'s bits on this machine,
    checked once on data that tells a fused multiply-add from a rounded product (ATen's
    ``addcmul_`` is one or the other depending on how it was built)."""
    gen = torch.Generator().manual_seed(0)
    q = QSGD(levels=8, bucket_size=5000)
    numel, first = 20011, 3
    codes = torch.randint(0, 17, (3, first + numel), generator=gen, dtype=torch.uint8)
    norms = torch.rand(3, 5, generator=gen) * 1000
    want = q._decode_sum(norms, codes[:, first:], numel, 3)
    got, _ = jit.qsgd_sum(
        pack_bits(codes, q.bits).numpy(), q.bits, first, numel, 5000,
        (norms / q.levels).numpy(), norms.sum(dim=0).numpy(), 3,
    )
    return bool(torch.equal(want.view(torch.int32), torch.from_numpy(got).view(torch.int32)))


def _jit_usable() -> bool:
    """The compiled decoder is enabled (:func:`gradzip.ops.jit.enabled`) and checked."""
    return jit.enabled() and _jit_checked()
