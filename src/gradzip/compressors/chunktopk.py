"""Chunked Top-k: the largest entries of every fixed-size chunk, with chunk-local indices."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gradzip._validate import check_choice, check_int, check_real
from gradzip.comm.base import Collective
from gradzip.compressors.base import Compressor, Job, StepContext, dense_reduce
from gradzip.compressors.sharded_sparse import (
    EXCHANGES,
    choose_exchange,
    outside_own_part,
    sharded_reduce,
)
from gradzip.feedback import residual_unsent
from gradzip.ops.binmean import binmean_decode, binmean_encode
from gradzip.ops.bits import code_width, pack_bits, packed_size, unpack_bits
from gradzip.ops.chunks import (
    chunk_flat_indices,
    chunk_layout,
    chunk_topk,
    pack_wide,
    unpack_wide,
    wide_size,
)
from gradzip.ops.flat import reinterpret

__all__ = ["AVERAGES", "ChunkTopK"]

#: How received entries are averaged: over every worker, or over the workers that sent each one.
AVERAGES = ("all", "senders")


@dataclass(frozen=True)
class ChunkTopK(Compressor):
    """Keep the ``k`` largest-magnitude entries of every chunk of ``chunk`` consecutive entries.

    Each tensor is flattened and cut into chunks (the last one shorter when ``chunk`` does not
    divide it, keeping at most its length). A kept entry's index is its position inside its
    chunk, packed at ``ceil(log2(chunk))`` bits (12 bits for 4,096-entry chunks). Values travel
    as fp32, or with ``bits`` > 0 as bin-mean codes (``2**bits`` bins over mean +- ``spread``
    standard deviations of the tensor's kept values, one fp32 codebook per tensor on the wire).
    Every worker sends the same number of entries, so messages are all-gathered unpadded; a
    tensor for which that costs more than a dense all-reduce is sent dense.

    Bytes per worker per tensor: ``kept * v + ceil(kept * index_bits / 8)`` with ``v = 4``
    (fp32 values), or ``4 * 2**bits + ceil(kept * bits / 8) + ceil(kept * index_bits / 8)``.

    Args:
        chunk: entries per chunk, in [2, 65536].
        k: entries kept per chunk, in [1, chunk].
        bits: 0 (fp32 values) or the bits of each value's code, in [1, 8].
        spread: half-width of the quantised range in standard deviations (with ``bits``).
        average: ``"all"``: the sum of the messages divided by the number of workers;
            ``"senders"``: each entry divided by the number of workers that sent it (then the
            average is not the mean of the decoded messages; error feedback still keeps what
            each worker did not send).
        exchange: ``"auto"`` (per tensor, the fewest wire bytes of dense, the all-gather and
            the sharded exchange of :mod:`gradzip.compressors.sharded_sparse`), ``"allgather"`` or
            ``"sharded"``. The sharded form carries each worker's chunk selection to the
            parts' owners as fp32 values with indices within the part (``bits`` does not
            apply there), and owners pass on the largest ``kept / W`` entries of their part's
            sum; it needs ``average="all"`` (an owner's sum mixes its residual in, so the
            senders of an entry are no longer known).
        owner_keep: in the sharded exchange, what each part's owner passes on, as a multiple
            of ``kept / W`` (an integer >= 1; 1 by default: the all-gather of 2-bit codes and
            12-bit indices is compact, and fp32 entries cost more each).

    References:
        Sarfi et al., "SparseLoCo: Communication-Efficient Sparse Low-Communication Training",
        2025; Peng et al., "DeMo: Decoupled Momentum Optimization", 2024.
    """

    chunk: int = 4096
    k: int = 64
    bits: int = 0
    spread: float = 6.0
    average: str = "all"
    exchange: str = "auto"
    owner_keep: int = 1
    spec_name: ClassVar[str] = "chunktopk"

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunk", check_int("chunk", self.chunk, minimum=2, maximum=65536))
        object.__setattr__(self, "k", check_int("k", self.k, minimum=1, maximum=self.chunk))
        object.__setattr__(self, "bits", check_int("bits", self.bits, minimum=0, maximum=8))
        object.__setattr__(self, "spread", check_real("spread", self.spread, low=0, low_open=True))
        object.__setattr__(self, "average", check_choice("average", self.average, AVERAGES))
        object.__setattr__(self, "exchange", check_choice("exchange", self.exchange, EXCHANGES))
        object.__setattr__(self, "owner_keep", check_int("owner_keep", self.owner_keep, minimum=1))
        if self.exchange == "sharded" and self.average != "all":
            raise ValueError(
                f"`exchange` 'sharded' needs `average` 'all', got average={self.average!r}"
            )

    @property
    def index_bits(self) -> int:
        """Bits of one chunk-local index."""
        return code_width(self.chunk - 1)

    def kept(self, numel: int) -> int:
        """Entries a tensor of ``numel`` entries sends."""
        return chunk_layout(numel, self.chunk, self.k).kept

    def message_bytes(self, numel: int) -> int:
        """Bytes one worker sends for a tensor of ``numel`` entries reduced sparsely."""
        kept = self.kept(numel)
        values = 4 * kept if self.bits == 0 else 4 * (1 << self.bits) + packed_size(kept, self.bits)
        return values + wide_size(kept, self.index_bits)

    def exchange_for(self, numel: int, world: int) -> str:
        """How a tensor of ``numel`` entries travels among ``world`` workers: ``"dense"``,
        ``"allgather"`` or ``"sharded"`` (shapes and configuration only: every worker agrees)."""
        return choose_exchange(self.exchange, numel, world, self.kept(numel),
                               self.message_bytes(numel), self.owner_keep,
                               sharded_ok=self.average == "all")

    def report(self, state: Any) -> dict[str, Any]:
        """The configured density (tensors sent dense are not counted apart)."""
        return {"density": min(self.k, self.chunk) / self.chunk}

    def reduce(
        self, jobs: Sequence[Job], state: dict[str, Any], comm: Collective, ctx: StepContext
    ) -> None:
        sparse, dense, sharded = [], [], []
        for job in jobs:
            # Per tensor, from sizes only: the same form on every worker, whatever the call.
            form = self.exchange_for(job.numel, comm.world_size)
            {"allgather": sparse, "dense": dense, "sharded": sharded}[form].append(job)
        dense_reduce(dense, comm)
        self._reduce_gathered(sparse, comm)
        # Last: an all-to-all cannot carry the engine's call header, so a call whose first
        # collective is the sharded exchange's sends the header apart.
        if sharded:
            # The positions alone (distinct, a fixed count): the exchange splits them among
            # the owners.
            picks = [chunk_topk(outside_own_part(job.tensor.reshape(comm.local_workers, -1),
                                                 comm), self.chunk, self.k)[1]
                     for job in sharded]
            sharded_reduce(sharded, picks, [self.kept(j.numel) for j in sharded], comm,
                           self.owner_keep)

    def _reduce_gathered(self, sparse: Sequence[Job], comm: Collective) -> None:
        if not sparse:
            return
        workers = comm.local_workers
        parts, flats = [], []
        for job in sparse:
            values, flat, local = chunk_topk(job.tensor.reshape(workers, -1), self.chunk, self.k)
            flats.append(flat)
            if self.bits == 0:
                parts.append(values.contiguous().view(torch.uint8))
                job.keep(residual_unsent(job.tensor, list(flat)))
            else:
                codebook, codes = binmean_encode(values, self.bits, self.spread)
                parts += [codebook.contiguous().view(torch.uint8), pack_bits(codes, self.bits)]
                own = torch.zeros(workers, job.numel, dtype=torch.float32, device=values.device)
                own.scatter_(1, flat, binmean_decode(codebook, codes))
                job.decoded = own.reshape(job.tensor.shape)
            parts.append(pack_wide(local, self.index_bits))
        gathered = comm.all_gather(torch.cat(parts, dim=1))  # [W, bytes] uint8, no padding
        offset = 0
        for job in sparse:
            kept = self.kept(job.numel)
            if self.bits == 0:
                values = reinterpret(gathered[:, offset : offset + 4 * kept], torch.float32)
                offset += 4 * kept
            else:
                bins = 1 << self.bits
                codebook = reinterpret(gathered[:, offset : offset + 4 * bins], torch.float32)
                offset += 4 * bins
                size = packed_size(kept, self.bits)
                codes = unpack_bits(gathered[:, offset : offset + size], self.bits, kept)
                offset += size
                values = binmean_decode(codebook, codes)
            size = wide_size(kept, self.index_bits)
            local = unpack_wide(gathered[:, offset : offset + size], self.index_bits, kept)
            offset += size
            flat = chunk_flat_indices(local, job.numel, self.chunk, self.k)
            job.averaged = self._average(values, flat, job.numel, comm.world_size).reshape(job.shape)

    def _average(self, values: torch.Tensor, flat: torch.Tensor, numel: int, world_size: int) -> torch.Tensor:
        total = torch.zeros(numel, dtype=torch.float32, device=values.device)
        # One worker's row at a time, in rank order (indices are distinct within a row), so
        # every rank adds in the same order and computes bit-identical averages.
        for row_idx, row_val in zip(flat, values, strict=True):
            total.index_add_(0, row_idx, row_val.to(torch.float32))
        if self.average == "all":
            return total.div_(world_size)
        senders = torch.zeros(numel, dtype=torch.float32, device=values.device)
        for row_idx in flat:
            senders.index_add_(0, row_idx, torch.ones(row_idx.shape, device=values.device))
        return torch.where(senders > 0, total / senders.clamp(min=1), 0.0)
