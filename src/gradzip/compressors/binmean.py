"""Bin-mean quantisation: a few bits per entry, each code decoded to its bin's mean."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gradzip._validate import check_int, check_real
from gradzip.comm.base import Collective
from gradzip.compressors.base import Compressor, Job, StepContext, dense_reduce, sparse_pays
from gradzip.ops.binmean import binmean_decode, binmean_encode
from gradzip.ops.bits import pack_bits, packed_size, unpack_bits
from gradzip.ops.flat import reinterpret

__all__ = ["BinMean"]


@dataclass(frozen=True)
class BinMean(Compressor):
    """Quantise every entry to one of ``2**bits`` bins over mean +- ``spread`` standard
    deviations of its tensor, and decode each code to the mean of the entries in its bin.

    The message of a tensor is its codebook (``2**bits`` fp32 bin means) and its codes packed
    at ``bits`` bits: ``4 * 2**bits + ceil(numel * bits / 8)`` bytes per worker. Messages are
    all-gathered and decoded in rank order; a tensor for which that costs more than a dense
    all-reduce (a small one: the codebook dominates) is sent dense. Deterministic (no
    rounding noise), hence biased: error feedback is on by default.

    Args:
        bits: bits per entry, in [1, 8].
        spread: half-width of the binned range in standard deviations, > 0.

    References:
        Jaghouar et al., "INTELLECT-1 Technical Report", 2024 (8 bits over mean +- 6 sigma);
        Sarfi et al., "SparseLoCo", 2025 (2 bits).
    """

    bits: int = 8
    spread: float = 6.0
    spec_name: ClassVar[str] = "binmean"

    def __post_init__(self) -> None:
        object.__setattr__(self, "bits", check_int("bits", self.bits, minimum=1, maximum=8))
        object.__setattr__(self, "spread", check_real("spread", self.spread, low=0, low_open=True))

    def message_bytes(self, numel: int) -> int:
        """Bytes one worker sends for a tensor of ``numel`` entries reduced quantised."""
        return 4 * (1 << self.bits) + packed_size(numel, self.bits)

    def report(self, state: Any) -> dict[str, Any]:
        """Bits per entry over fp32's 32, as a density of the dense message."""
        return {"density": self.bits / 32}

    def reduce(
        self, jobs: Sequence[Job], state: dict[str, Any], comm: Collective, ctx: StepContext
    ) -> None:
        quantised, dense = [], []
        for job in jobs:
            pays = sparse_pays(job.numel, self.message_bytes(job.numel), 1, comm)
            (quantised if pays else dense).append(job)
        dense_reduce(dense, comm)
        if not quantised:
            return
        workers, parts = comm.local_workers, []
        for job in quantised:
            codebook, codes = binmean_encode(job.tensor.reshape(workers, -1), self.bits, self.spread)
            job.decoded = binmean_decode(codebook, codes).reshape(job.tensor.shape)
            parts += [codebook.contiguous().view(torch.uint8), pack_bits(codes, self.bits)]
        gathered = comm.all_gather(torch.cat(parts, dim=1))  # [W, bytes] uint8
        offset, bins = 0, 1 << self.bits
        for job in quantised:
            codebook = reinterpret(gathered[:, offset : offset + 4 * bins], torch.float32)
            offset += 4 * bins
            size = packed_size(job.numel, self.bits)
            codes = unpack_bits(gathered[:, offset : offset + size], self.bits, job.numel)
            offset += size
            values = binmean_decode(codebook, codes)
            total = values[0].clone()
            for row in values[1:]:  # rank order: the same sum on every worker
                total += row
            job.averaged = total.div_(comm.world_size).reshape(job.shape)
