"""Bin-mean quantisation: a few bits per entry, each code decoded to its bin's mean."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gradzip._validate import check_choice, check_int, check_real
from gradzip.comm.base import Collective
from gradzip.compressors.base import Compressor, Job, StepContext, dense_reduce, sparse_pays
from gradzip.compressors.sharded_codes import (
    EXCHANGES,
    ExchangeStateCheck,
    exchange_report,
    init_exchange_state,
    sharded_reduce,
    split_by_form,
)
from gradzip.ops.binmean import binmean_decode, binmean_encode
from gradzip.ops.bits import pack_bits, packed_size, unpack_bits
from gradzip.ops.flat import reinterpret

__all__ = ["BinMean", "BinMeanCodec"]


@dataclass(frozen=True)
class BinMeanCodec:
    """Bin-mean codes of one part (a :class:`~gradzip.compressors.sharded_codes.PartCodec`): its
    codebook (``2**bits`` fp32 bin means), then its codes packed at ``bits`` bits.

    Args:
        bits: bits per entry, in [1, 8].
        spread: half-width of the binned range in standard deviations, > 0.
    """

    bits: int
    spread: float

    def part_bytes(self, count: int) -> int:
        """Bytes of the message of ``count`` entries."""
        return 4 * (1 << self.bits) + packed_size(count, self.bits)

    def encode_parts(self, x: torch.Tensor, draws: torch.Tensor | None) -> torch.Tensor:
        """``x[R, m]`` -> messages ``[R, part_bytes(m)]``, each row with its own codebook."""
        codebook, codes = binmean_encode(x, self.bits, self.spread)
        return torch.cat([codebook.contiguous().view(torch.uint8), pack_bits(codes, self.bits)],
                         dim=1)

    def decode_parts(self, messages: torch.Tensor, count: int) -> torch.Tensor:
        """Messages ``[R, part_bytes(count)]`` -> values ``[R, count]``."""
        head = 4 * (1 << self.bits)
        codebook = reinterpret(messages[:, :head], torch.float32)
        return binmean_decode(codebook, unpack_bits(messages[:, head:], self.bits, count))

    def part_draws(self, key: tuple[Any, ...], count: int, device: torch.device) -> None:
        """No draws: the code is deterministic."""
        return None


@dataclass(frozen=True)
class BinMean(ExchangeStateCheck, Compressor):
    """Quantise every entry to one of ``2**bits`` bins over mean +- ``spread`` standard
    deviations of its tensor, and decode each code to the mean of the entries in its bin.

    The message of a tensor is its codebook (``2**bits`` fp32 bin means) and its codes packed
    at ``bits`` bits: ``4 * 2**bits + ceil(numel * bits / 8)`` bytes per worker. A tensor's
    messages are all-gathered and decoded in rank order, or go through the sharded exchange
    (each part of ``ceil(n / W)`` entries with its own codebook, averaged and quantised again
    by its owner, whose error is kept; :mod:`gradzip.compressors.sharded_codes`), or the tensor is
    sent dense where that costs fewer wire bytes (a small one: the codebook dominates).
    Deterministic (no rounding noise), hence biased: error feedback is on by default.

    Args:
        bits: bits per entry, in [1, 8].
        spread: half-width of the binned range in standard deviations, > 0.
        exchange: ``"auto"`` (the form with the fewest wire bytes), ``"allgather"`` (the
            all-gather, or dense where that is cheaper) or ``"sharded"``.

    References:
        Jaghouar et al., "INTELLECT-1 Technical Report", 2024 (8 bits over mean +- 6 sigma);
        Sarfi et al., "SparseLoCo", 2025 (2 bits).
    """

    bits: int = 8
    spread: float = 6.0
    exchange: str = "auto"
    spec_name: ClassVar[str] = "binmean"

    def __post_init__(self) -> None:
        object.__setattr__(self, "bits", check_int("bits", self.bits, minimum=1, maximum=8))
        object.__setattr__(self, "spread", check_real("spread", self.spread, low=0, low_open=True))
        object.__setattr__(self, "exchange", check_choice("exchange", self.exchange, EXCHANGES))

    def message_bytes(self, numel: int) -> int:
        """Bytes one worker sends for a tensor of ``numel`` entries reduced quantised."""
        return 4 * (1 << self.bits) + packed_size(numel, self.bits)

    @property
    def codec(self) -> BinMeanCodec:
        """The code of one part, for the sharded exchange."""
        return BinMeanCodec(self.bits, self.spread)

    def init_group_state(
        self, shapes: Mapping[str, torch.Size], world_size: int, local_workers: int
    ) -> dict[str, Any]:
        """Each tensor's form and the owner residuals of the sharded ones."""
        return init_exchange_state(self.codec, self.exchange, shapes, world_size, local_workers)

    def report(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Bits per entry over fp32's 32, as a density of the dense message; tensors per
        exchange form (when the state was made for a group)."""
        found = exchange_report(state)
        return {"density": self.bits / 32, **({"exchange": found} if found else {})}

    def reduce(
        self, jobs: Sequence[Job], state: dict[str, Any], comm: Collective, ctx: StepContext
    ) -> None:
        # Every rank splits alike: a tensor's form depends on its size and the world size.
        forms = split_by_form(jobs, self.codec, self.exchange, comm.world_size)
        dense_reduce(forms["dense"], comm)
        self._reduce_gathered(forms["allgather"], comm)
        sharded_reduce(forms["sharded"], state, comm, ctx, self.codec, "sharded")

    def _reduce_gathered(self, jobs: Sequence[Job], comm: Collective) -> None:
        """Every worker's message of ``jobs`` all-gathered (or dense where that is cheaper),
        decoded and averaged in rank order."""
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
