"""Scaled sign compression: one bit per entry plus one scale per tensor."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from gradzip.comm.base import Collective
from gradzip.compressors.base import Compressor, Job, StepContext
from gradzip.ops.bits import (
    MAX_KEY_WORKERS,
    bit_keys,
    keys_per_byte,
    pack_bits,
    packed_size,
    unpack_bits,
)
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
            if flat.shape[1] == 0:  # an empty tensor: no mean (NaN), its scale is sent as 0
                scale = flat.new_zeros(workers, 1)
            else:
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
        gathered = comm.all_gather(torch.cat([head, pack_bits(torch.cat(signs, dim=1), 1, checked=False)], dim=1))
        all_scales = reinterpret(gathered[:, : head.shape[1]], torch.float32)  # [W, T]
        payload = gathered[:, head.shape[1] :]
        if payload.device.type == "cpu" and MAX_KEY_WORKERS > 0:
            _average_by_table(jobs, payload, all_scales, comm.world_size)
            return
        bits = unpack_bits(payload, 1, total)  # [W, total]
        start = 0
        for t, job in enumerate(jobs):
            mine = bits[:, start : start + job.numel]
            start += job.numel
            job.averaged = _sign_average(mine, all_scales[:, t], comm.world_size).reshape(job.shape)


def _sign_sum(bits: torch.Tensor, scale: torch.Tensor, acc: torch.Tensor | None = None) -> torch.Tensor:
    """``acc + sum_w 2 scale_w b_w`` over the rows of ``bits[w, m]`` (uint8 0/1) with
    ``scale[w]``, added worker by worker in rank order (the same on every worker) without a
    float tensor per worker; ``acc`` (float32 ``[m]``, updated in place) starts at zero."""
    if acc is None:
        acc = torch.zeros(bits.shape[1], dtype=torch.float32, device=bits.device)
    for w in range(bits.shape[0]):
        acc.addcmul_(bits[w], 2 * scale[w])
    return acc


def _finish(acc: torch.Tensor, scale: torch.Tensor, world_size: int) -> torch.Tensor:
    """``(acc - sum_w scale_w) / world_size`` in place: the average of ``scale_w (2 b_w - 1)``."""
    return acc.sub_(scale.sum()).div_(world_size)


def _sign_average(bits: torch.Tensor, scale: torch.Tensor, world_size: int) -> torch.Tensor:
    """The average of ``scale_w (2 b_w - 1)`` over the rows of ``bits[W, m]``: this sequence of
    operations (:func:`_sign_sum`, then :func:`_finish`) defines the average's bits."""
    return _finish(_sign_sum(bits, scale), scale, world_size)


def _average_by_table(
    jobs: Sequence[Job], payload: torch.Tensor, scales: torch.Tensor, world_size: int
) -> None:
    """Every job's average from the packed bits ``payload[W, bytes]`` (CPU), equal to
    :func:`_sign_average` bit for bit.

    The sum over the first ``G = min(W, 8)`` workers depends only on an entry's ``G`` sign
    bits, so the ``2**G`` possible values are computed by the same operations (one per
    combination of bits) and each entry is looked up. :func:`bit_keys` interleaves the
    workers' packed bytes into keys covering ``e`` entries each (``e * G <= 8``), and a table
    of ``e`` floats per key value writes ``e`` entries per lookup: no unpacked bits, no float
    tensor per worker. With ``W <= 8`` the table holds the finished averages, so one pass
    writes the result; further workers are added one by one in rank order, then the average
    is finished, exactly as the plain sequence does.
    """
    workers = payload.shape[0]
    head = min(workers, MAX_KEY_WORKERS)
    e = keys_per_byte(head)
    keys = bit_keys(payload[:head].numpy())
    rest = unpack_bits(payload[head:], 1, sum(job.numel for job in jobs)) if workers > head else None
    combos = torch.arange(1 << head)
    combo_bits = ((combos.unsqueeze(0) >> torch.arange(head).unsqueeze(1)) & 1).to(torch.uint8)
    # Key k holds combination (k >> (j * G)) & (2**G - 1) for its entry j.
    shifts = torch.arange(e) * head
    parts = (torch.arange(1 << (e * head)).unsqueeze(1) >> shifts) & ((1 << head) - 1)
    start = 0
    for t, job in enumerate(jobs):
        scale = scales[:, t]
        values = _sign_sum(combo_bits, scale[:head])  # [2**G]
        if rest is None:
            values = _finish(values, scale, world_size)
        table = values.index_select(0, parts.reshape(-1)).reshape(-1, e).numpy()
        first, last = start // e, -(-(start + job.numel) // e)
        looked_up = np.take(table, keys[first:last], axis=0, mode="clip").reshape(-1)
        skip = start - first * e
        averaged = torch.from_numpy(looked_up[skip : skip + job.numel])
        if rest is not None:
            _sign_sum(rest[:, start : start + job.numel], scale[head:], averaged)
            _finish(averaged, scale, world_size)
        job.averaged = averaged.reshape(job.shape)
        start += job.numel
