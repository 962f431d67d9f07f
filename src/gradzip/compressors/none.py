"""Exact dense all-reduce: the baseline every other compressor is compared with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from gradzip.comm.base import Collective
from gradzip.compressors.base import Compressor, Job, StepContext, dense_reduce

__all__ = ["NoCompression"]


@dataclass(frozen=True)
class NoCompression(Compressor):
    """Send every gradient as it is (fp32 all-reduce). Error feedback is pointless here."""

    spec_name: ClassVar[str] = "none"
    biased: ClassVar[bool] = False
    device_decisions: ClassVar[bool] = True

    def reduce(
        self, jobs: Sequence[Job], state: dict[str, Any], comm: Collective, ctx: StepContext
    ) -> None:
        dense_reduce(jobs, comm)
