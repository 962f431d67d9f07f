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


def _mean_abs_scaled(flat: torch.Tensor) -> torch.Tensor:
    """``mean(|x|)`` per row when the plain sum overflows although every entry is finite:
    the rows are scaled by a power of two first (exact), so the mean is finite whenever it is
    representable. Without this, one huge entry left in a residual (spread over the whole
    tensor by the previous scale) would make every later step overflow."""
    top = flat.abs().amax(dim=1, keepdim=True)
    shift = torch.exp2(torch.floor(torch.log2(torch.where(top > 0, top, 1.0))))  # <= top: finite
    return (flat / shift).abs().mean(dim=1, keepdim=True) * shift


@dataclass(frozen=True)
class Sign(Compressor):
    """Send ``mean(|g|) * sign(g)``: one fp32 scale per tensor and the sign bits packed 8 to a
    byte (all tensors of one call in one stream).

    Zero entries are sent as positive (one bit cannot say zero); error feedback corrects that.
    Messages are all-gathered.

    References:
        Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression
        Schemes", ICML 2019 (scaled sign with error feedback); Seide et al., "1-bit SGD", 2014.
    """

    spec_name: ClassVar[str] = "sign"

    @staticmethod
    def message_bytes(*numels: int) -> int:
        """Bytes of one worker's message for tensors of these sizes reduced in one call: one
        fp32 scale per tensor, then all sign bits packed as one stream."""
        return 4 * len(numels) + packed_size(sum(numels), 1)

    def reduce(
        self, jobs: Sequence[Job], state: dict[str, Any], comm: Collective, ctx: StepContext
    ) -> None:
        if not jobs:
            return
        workers = comm.local_workers
        scales, signs = [], []
        for job in jobs:
            flat = job.tensor.reshape(workers, -1)
            scale = flat.abs().mean(dim=1, keepdim=True)  # [L, 1]
            if not bool(torch.isfinite(scale).all()):
                scale = _mean_abs_scaled(flat)
            bits = (flat >= 0).to(torch.uint8)
            job.decoded = ((bits.to(torch.float32) * 2 - 1) * scale).reshape(job.tensor.shape)
            scales.append(scale)
            signs.append(bits)
        # One message per call: every tensor's scale, then all sign bits as one packed stream.
        total = sum(job.numel for job in jobs)
        head = torch.cat(scales, dim=1).contiguous().view(torch.uint8)  # [L, 4 T]
        gathered = comm.all_gather(torch.cat([head, pack_bits(torch.cat(signs, dim=1), 1)], dim=1))
        all_scales = reinterpret(gathered[:, : head.shape[1]], torch.float32)  # [W, T]
        bits = unpack_bits(gathered[:, head.shape[1] :], 1, total)  # [W, total]
        start = 0
        for t, job in enumerate(jobs):
            mine, scale = bits[:, start : start + job.numel], all_scales[:, t]
            start += job.numel
            # sum_w scale_w (2 b_w - 1), accumulated worker by worker in rank order (the same
            # on every worker) without a float tensor per worker.
            acc = torch.zeros(job.numel, dtype=torch.float32, device=bits.device)
            for w in range(mine.shape[0]):
                acc.addcmul_(mine[w], 2 * scale[w])
            acc.sub_(scale.sum())
            job.averaged = acc.div_(comm.world_size).reshape(job.shape)
