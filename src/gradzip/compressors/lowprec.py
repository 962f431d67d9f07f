"""Half-precision all-reduce (fp16 or bf16)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gradzip.comm.base import Collective
from gradzip.compressors.base import Compressor, Job, StepContext, give_averages

__all__ = ["BF16", "FP16"]


class _LowPrecision(Compressor):
    biased: ClassVar[bool] = False
    device_decisions: ClassVar[bool] = True
    dtype: ClassVar[torch.dtype] = torch.float16

    def reduce(
        self, jobs: Sequence[Job], state: dict[str, Any], comm: Collective, ctx: StepContext
    ) -> None:
        if not jobs:
            return
        # Divide before summing: W fp16 gradients can overflow their sum where their average
        # would not. Per tensor, then concatenated once by the collective.
        pieces = [(j.tensor / comm.world_size).to(self.dtype) for j in jobs]
        total = comm.all_reduce_cat(pieces).to(torch.float32)
        give_averages(jobs, total)
        for job, piece in zip(jobs, pieces, strict=True):
            job.decoded = piece.to(torch.float32) * comm.world_size


@dataclass(frozen=True)
class FP16(_LowPrecision):
    """Cast to IEEE half precision, divide by the world size, all-reduce in fp16."""

    spec_name: ClassVar[str] = "fp16"
    dtype: ClassVar[torch.dtype] = torch.float16


@dataclass(frozen=True)
class BF16(_LowPrecision):
    """Cast to bfloat16 (fp32's range, 8 bits of mantissa), divide, all-reduce in bf16."""

    spec_name: ClassVar[str] = "bf16"
    dtype: ClassVar[torch.dtype] = torch.bfloat16
