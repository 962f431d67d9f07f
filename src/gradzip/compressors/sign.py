"""Scaled sign compression: one bit per entry plus one scale per tensor."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gradzip.comm.base import Collective
from gradzip.compressors.base import Compressor, Job, StepContext
from gradzip.ops.bits import pack_bits, packed_size, unpack_bits
from gradzip.ops.flat import reinterpret

__all__ = ["Sign"]


@dataclass(frozen=True)
class Sign(Compressor):
    """Send ``mean(|g|) * sign(g)``: the sign bits packed 8 to a byte and one fp32 scale.

    Zero entries are sent as positive (one bit cannot say zero); error feedback corrects that.
    Messages are all-gathered.

    References:
        Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression
        Schemes", ICML 2019 (scaled sign with error feedback); Seide et al., "1-bit SGD", 2014.
    """

    spec_name: ClassVar[str] = "sign"

    @staticmethod
    def message_bytes(numel: int) -> int:
        return 4 + packed_size(numel, 1)

    def reduce(
        self, jobs: Sequence[Job], state: dict[str, Any], comm: Collective, ctx: StepContext
    ) -> None:
        if not jobs:
            return
        workers = comm.local_workers
        parts = []
        for job in jobs:
            flat = job.tensor.reshape(workers, -1)
            scale = flat.abs().mean(dim=1, keepdim=True)  # [L, 1]
            bits = (flat >= 0).to(torch.uint8)
            job.decoded = ((bits.to(torch.float32) * 2 - 1) * scale).reshape(job.tensor.shape)
            parts.append(scale.contiguous().view(torch.uint8))
            parts.append(pack_bits(bits, 1))
        gathered = comm.all_gather(torch.cat(parts, dim=1))
        offset = 0
        for job in jobs:
            scale = reinterpret(gathered[:, offset : offset + 4], torch.float32)  # [W, 1]
            nbytes = packed_size(job.numel, 1)
            bits = unpack_bits(gathered[:, offset + 4 : offset + 4 + nbytes], 1, job.numel)
            offset += 4 + nbytes
            # sum_w scale_w (2 b_w - 1), accumulated worker by worker in rank order (the same
            # on every worker) without a float tensor per worker.
            total = torch.zeros(job.numel, dtype=torch.float32, device=bits.device)
            for w in range(bits.shape[0]):
                total.addcmul_(bits[w], 2 * scale[w])
            total.sub_(scale.sum())
            job.averaged = total.div_(comm.world_size).reshape(job.shape)
