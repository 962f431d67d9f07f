"""Scaled sign compression: one bit per entry plus one scale per tensor."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from gradzip._validate import check_choice
from gradzip.comm.base import Collective
from gradzip.compressors.base import (
    Compressor,
    Job,
    SegmentPlan,
    StepContext,
    dense_reduce,
    dense_tail,
    gathered_or_dense_plan,
    give_averages,
    job_rows,
)
from gradzip.compressors.sharded_codes import (
    EXCHANGES,
    ExchangeStateCheck,
    choose_exchange,
    exchange_report,
    init_exchange_state,
    sharded_reduce,
    split_by_form,
)
from gradzip.feedback import residual_after
from gradzip.ops.bits import (
    MAX_KEY_WORKERS,
    bit_keys,
    keys_per_byte,
    pack_bits,
    packed_size,
    unpack_bits,
)
from gradzip.ops.branches import cpu_form
from gradzip.ops.flat import reinterpret, to_device
from gradzip.ops.segquant import SegmentLayout, join_rows, segment_layout, segment_sums

__all__ = ["Sign"]


def _mean_abs(flat: torch.Tensor, layout: SegmentLayout) -> torch.Tensor:
    """``mean(|x|)`` of every tensor laid end to end in the rows of ``flat[L, total]``: one
    indexed float64 sum of the magnitudes per row (:func:`~gradzip.ops.segquant.segment_sums`),
    a few ops per call whatever the number of tensors. In float64 the sums of float32
    magnitudes cannot overflow (so no host test for an overflowed float32 sum is needed), and
    each tensor's sum is its own entries' only (on the CPU, added in order), so a tensor's
    scale does not depend on the tensors sharing its call; the mean is rounded to float32
    once (it can differ from a float32 ``mean`` in the last bit). An empty tensor's is 0."""
    sums = segment_sums(flat.abs(), layout.owner, len(layout.numels))
    return (sums / _counts(layout.numels, flat.device)).to(torch.float32)  # [L, T]


@functools.lru_cache(maxsize=64)
def _counts_on(numels: tuple[int, ...], device: str) -> torch.Tensor:
    return to_device(torch.tensor([max(n, 1) for n in numels], dtype=torch.float64), device)


def _counts(numels: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """float64 ``[T]``: each tensor's entry count (at least 1), cached per layout and device."""
    return _counts_on(numels, str(device))


@dataclass(frozen=True)
class Sign(ExchangeStateCheck, Compressor):
    """Send ``mean(|g|) * sign(g)``: one fp32 scale per tensor and the sign bits packed 8 to a
    byte (all tensors of one call in one stream).

    Zero entries are sent as positive (one bit cannot say zero); error feedback corrects that.
    A tensor travels all-gathered, through the sharded exchange (each part of ``ceil(n / W)``
    entries with its own scale, averaged and signed again by its owner, whose error is kept;
    :mod:`gradzip.compressors.sharded_codes`) or dense, whichever ``exchange`` and the byte
    formulas choose (:func:`~gradzip.compressors.sharded_codes.choose_exchange`).

    Args:
        exchange: ``"auto"`` (the form with the fewest wire bytes), ``"allgather"`` or
            ``"sharded"``.

    References:
        Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression
        Schemes", ICML 2019 (scaled sign with error feedback); Seide et al., "1-bit SGD", 2014;
        Tang et al., "DoubleSqueeze", ICML 2019 (the owner's error feedback).
    """

    exchange: str = "auto"
    spec_name: ClassVar[str] = "sign"
    device_decisions: ClassVar[bool] = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "exchange", check_choice("exchange", self.exchange, EXCHANGES))

    def init_group_state(
        self, shapes: Mapping[str, torch.Size], world_size: int, local_workers: int
    ) -> dict[str, Any]:
        """Each tensor's form and the owner residuals of the sharded ones."""
        return init_exchange_state(self, self.exchange, shapes, world_size, local_workers)

    def report(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Tensors per exchange form (when the state was made for a group)."""
        found = exchange_report(state)
        return {"exchange": found} if found else {}

    # -- the code of one part, for the sharded exchange (gradzip.compressors.sharded_codes) ------
    @staticmethod
    def part_bytes(count: int) -> int:
        """Bytes of the message of ``count`` entries: its fp32 scale, then its sign bits."""
        return 4 + packed_size(count, 1)

    @staticmethod
    def encode_parts(x: torch.Tensor, draws: torch.Tensor | None) -> torch.Tensor:
        """``x[R, m]`` -> messages ``[R, part_bytes(m)]``: each row's ``mean(|x|)`` (summed in
        float64, which cannot overflow, rounded to float32 once) and its sign bits."""
        scale = (x.abs().sum(dim=1, keepdim=True, dtype=torch.float64) / x.shape[1])
        head = scale.to(torch.float32).contiguous().view(torch.uint8)  # [R, 4]
        return torch.cat([head, pack_bits((x >= 0).to(torch.uint8), 1, checked=False)], dim=1)

    @staticmethod
    def decode_parts(messages: torch.Tensor, count: int) -> torch.Tensor:
        """Messages ``[R, part_bytes(count)]`` -> values ``[R, count]``."""
        scale = reinterpret(messages[:, :4], torch.float32)  # [R, 1]
        return (unpack_bits(messages[:, 4:], 1, count).to(torch.float32) * 2 - 1) * scale

    @staticmethod
    def part_draws(key: tuple[Any, ...], count: int, device: torch.device) -> None:
        """No draws: the sign is deterministic."""
        return None

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
        # Every rank splits alike: a tensor's form depends on its size and the world size.
        forms = split_by_form(jobs, self, self.exchange, comm.world_size)
        dense_reduce(forms["dense"], comm)
        self._reduce_gathered(forms["allgather"], comm)
        sharded_reduce(forms["sharded"], state, comm, ctx, self, "sharded")

    def _reduce_gathered(self, jobs: Sequence[Job], comm: Collective) -> None:
        """Every worker's message of ``jobs`` all-gathered, each decoded and averaged."""
        if not jobs:
            return
        numels = tuple(job.numel for job in jobs)
        layout = segment_layout(numels, 0, jobs[0].tensor.device)
        # The call's tensors as one flat buffer: every step below is one op per call.
        flat = join_rows([job.tensor for job in jobs], comm.local_workers)
        decoded, averaged = _gathered(flat, layout, comm)
        # What error feedback keeps, for the whole call in one subtraction (the contract's
        # ``tensor - decoded``, recorded here where the call's buffer is at hand).
        residual = residual_after(flat, decoded)
        for job, part, rest in zip(jobs, job_rows(jobs, decoded), job_rows(jobs, residual),
                                   strict=True):
            job.decoded = part
            job.keep(rest)
        give_averages(jobs, averaged)

    def segment_plan(
        self, names: Sequence[str], sizes: Sequence[int], world_size: int, device: torch.device,
        shapes: Sequence[torch.Size] | None = None, *, state: Mapping[str, Any] | None = None,
    ) -> SegmentPlan | None:
        """The row's order (the all-gathered tensors, then those sent dense, each kind in
        the engine's order, as :meth:`reduce` groups them) and the layout of the
        all-gathered ones, where no tensor takes the sharded exchange (see
        :meth:`~gradzip.compressors.base.Compressor.segment_plan`); else ``None``."""
        return gathered_or_dense_plan(
            [choose_exchange(self, self.exchange, n, world_size) for n in sizes], sizes,
            lambda picked: segment_layout(tuple(sizes[i] for i in picked), 0, device))

    def reduce_segments(
        self, flat: torch.Tensor, plan: SegmentPlan, state: dict[str, Any], comm: Collective,
        ctx: StepContext, raw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`reduce` on tensors already laid end to end (see
        :meth:`~gradzip.compressors.base.Compressor.reduce_segments`): the dense tensors'
        all-reduce first, then the all-gathered ones' one message; the same averages."""
        layout, count = plan.data
        average = dense_tail(flat, count, comm)
        if layout is not None:
            rows = flat[:, :count]
            decoded, _ = _gathered(rows, layout, comm, out=average[:count])
            rows.sub_(decoded)  # the residual, elementwise the ordinary ``flat - decoded``
        return average


def _gathered(
    flat: torch.Tensor, layout: SegmentLayout, comm: Collective, out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensors laid end to end in the rows of ``flat[L, total]`` sent as one message per
    worker (every tensor's scale, then all sign bits as one packed stream), all-gathered;
    returns ``(decoded, averaged)``: ``[L, total]`` what each local worker's own message
    decodes to, and ``[total]`` the average of every worker's (written into ``out`` where
    given, else a new tensor)."""
    owner = layout.owner
    scale = _mean_abs(flat, layout)  # [L, T]; an empty tensor's scale is 0
    bits = flat >= 0
    # +scale where the bit is set, -scale elsewhere: the decode's ``(2 b - 1) * scale``.
    per_entry = scale.index_select(1, owner)
    decoded = torch.where(bits, per_entry, -per_entry)
    head = scale.contiguous().view(torch.uint8)  # [L, 4 T]
    gathered = comm.all_gather(torch.cat([head, pack_bits(bits, 1, checked=False)], dim=1))
    all_scales = reinterpret(gathered[:, : head.shape[1]], torch.float32)  # [W, T]
    payload = gathered[:, head.shape[1] :]
    if cpu_form(payload.device) and MAX_KEY_WORKERS > 0:
        return decoded, _average_by_table(layout.numels, payload, all_scales, comm.world_size,
                                          out)
    averaged = _average_together(unpack_bits(payload, 1, layout.total), all_scales, owner,
                                 comm.world_size, out)
    return decoded, averaged


def _sign_sum(bits: torch.Tensor, scale: torch.Tensor, acc: torch.Tensor | None = None) -> torch.Tensor:
    """``acc + sum_w 2 scale_w b_w`` over the rows of ``bits[w, m]`` (uint8 0/1) with
    ``scale[w]`` (a scalar, or one per entry: ``scale[w, m]``), added worker by worker in rank order (the same on every worker) without a
    float tensor per worker; ``acc`` (float32 ``[m]``, updated in place) starts at zero."""
    if acc is None:
        acc = torch.zeros(bits.shape[1], dtype=torch.float32, device=bits.device)
    for w in range(bits.shape[0]):
        acc.addcmul_(bits[w], 2 * scale[w])
    return acc


def _scale_total(scale: torch.Tensor) -> torch.Tensor:
    """``sum_w scale[w]`` over the first dimension, added in rank order: the same bits for one
    tensor's scales ``[W]`` as for every tensor's at once (``[W, T]``), which a reduction
    kernel does not promise."""
    total = scale[0].clone()
    for w in range(1, scale.shape[0]):
        total += scale[w]
    return total


def _finish(acc: torch.Tensor, scale: torch.Tensor, world_size: int) -> torch.Tensor:
    """``(acc - sum_w scale_w) / world_size`` in place: the average of ``scale_w (2 b_w - 1)``."""
    return acc.sub_(_scale_total(scale)).div_(world_size)


def _sign_average(bits: torch.Tensor, scale: torch.Tensor, world_size: int) -> torch.Tensor:
    """The average of ``scale_w (2 b_w - 1)`` over the rows of ``bits[W, m]``: this sequence of
    operations (:func:`_sign_sum`, then :func:`_finish`) defines the average's bits."""
    return _finish(_sign_sum(bits, scale), scale, world_size)


def _average_together(
    bits: torch.Tensor, scales: torch.Tensor, owner: torch.Tensor, world_size: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every tensor's average (``[total]``, end to end) from the unpacked bits
    ``bits[W, total]`` and the scales ``scales[W, T]`` (``owner``: each entry's tensor), all
    tensors at once: each entry sees the operations of :func:`_sign_average` (its own
    tensor's scales, workers added in rank order, then the sum of its tensor's scales taken
    off), so the bits are the same. Written into ``out`` where given."""
    per_entry = scales.index_select(1, owner)  # [W, total]
    acc = _sign_sum(bits, per_entry, None if out is None else out.zero_())
    offsets = _scale_total(scales)  # [T], each as _finish sums one tensor's
    return acc.sub_(offsets.index_select(0, owner)).div_(world_size)


def _average_by_table(
    numels: Sequence[int], payload: torch.Tensor, scales: torch.Tensor, world_size: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every tensor's average (``[total]``, tensors of ``numels`` entries end to end, written
    into ``out`` where given) from the packed bits ``payload[W, bytes]`` (CPU), equal to
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
    total = sum(numels)
    rest = unpack_bits(payload[head:], 1, total) if workers > head else None
    combos = torch.arange(1 << head)
    combo_bits = ((combos.unsqueeze(0) >> torch.arange(head).unsqueeze(1)) & 1).to(torch.uint8)
    # Key k holds combination (k >> (j * G)) & (2**G - 1) for its entry j.
    shifts = torch.arange(e) * head
    parts = (torch.arange(1 << (e * head)).unsqueeze(1) >> shifts) & ((1 << head) - 1)
    # Every tensor's table at once ([T, 2**G] sums, then [T, keys, e]): each value sees the
    # operations _sign_sum and _finish apply to its tensor alone.
    values = torch.zeros(len(numels), 1 << head, dtype=torch.float32)
    for w in range(head):
        values.addcmul_(combo_bits[w].unsqueeze(0), (2 * scales[w]).unsqueeze(1))
    if rest is None:
        values.sub_(_scale_total(scales).unsqueeze(1)).div_(world_size)
    tables = values.index_select(1, parts.reshape(-1)).reshape(len(numels), -1, e).numpy()
    if out is None:
        out = torch.empty(total, dtype=torch.float32)
    start = 0
    for t, numel in enumerate(numels):
        scale, table = scales[:, t], tables[t]
        first, last = start // e, -(-(start + numel) // e)
        looked_up = np.take(table, keys[first:last], axis=0, mode="clip").reshape(-1)
        skip = start - first * e
        averaged = torch.from_numpy(looked_up[skip : skip + numel])
        if rest is not None:
            _sign_sum(rest[:, start : start + numel], scale[head:], averaged)
            _finish(averaged, scale, world_size)
        out[start : start + numel] = averaged
        start += numel
    return out
