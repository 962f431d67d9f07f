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
from gradzip.ops import jit
from gradzip.ops.bits import code_width, pack_bits, packed_size, unpack_bits
from gradzip.ops.branches import cpu_form
from gradzip.ops.checks import check_on_device
from gradzip.ops.flat import reinterpret
from gradzip.ops.segquant import (
    UNIT,
    SegmentLayout,
    join_rows,
    key32,
    keyed_draws,
    segment_layout,
    segment_sums,
)

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
    The rounding noise is drawn where the tensors live, for a whole call at once, by a keyed
    integer hash of ``(seed, step, name, rank)`` and each entry's position in its tensor
    (:func:`~gradzip.ops.segquant.keyed_uniform`): the same bits on every device and in every
    grouping of tensors into calls, never the global generator. Each entry rounds its scaled
    value ``x * levels / norm`` down or up as ``floor(scaled + u)`` does with its draw ``u``:
    up with probability its fraction, so the code is unbiased.

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

    def _quantise(
        self, x: torch.Tensor, draws: torch.Tensor, layout: SegmentLayout
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x[L, n]`` (a call's tensors side by side, cut into the buckets of ``layout``) with
        draws ``[L, n]`` (:func:`~gradzip.ops.segquant.keyed_draws`, ``u = draws * UNIT``
        uniform in ``[0, 1)``) -> (norms ``[L, buckets]`` fp32, signed levels ``[L, n]`` fp32
        in ``[-levels, levels]``, what they decode to ``[L, n]``), a fixed number of ops
        whatever the number of tensors.

        A bucket's norm is the square root of its float64 sum of squares, rounded to float32
        once; with its step ``norm / levels``, an entry's level is ``floor(x / step + u)`` and
        it decodes to ``level * step``: each entry sees the same operations whichever tensors
        share its call.
        """
        squares = segment_sums(x * x, layout.segment, layout.segments)
        norms = squares.sqrt_().to(torch.float32)  # [L, buckets]
        steps = (norms / self.levels).index_select(1, layout.segment)  # [L, n]
        # A zero bucket (all its entries zero) gives 0 / 0: NaN levels, like a non-finite input.
        level = torch.add(x / steps, draws, alpha=UNIT).floor_()  # u folded in (exact product)
        # NaN levels become 0 so every code stays in range (the engine discards a non-finite
        # call's result, but the message must still decode).
        level = level.nan_to_num_(0.0).clamp_(-self.levels, self.levels)
        return norms, level, level * steps

    def _keys(self, jobs: Sequence[Job], ctx: StepContext) -> list[list[int]]:
        """Every local worker's noise key of every job: ``(seed, step, name, rank)``."""
        return _keys_of(self.seed, [job.name for job in jobs], ctx)

    # -- the code of one part, for the sharded exchange (gradzip.compressors.sharded_codes) ------
    def part_bytes(self, count: int) -> int:
        """Bytes of the message of ``count`` entries: its buckets' norms, then its codes."""
        return 4 * self._layout(count)[0] + packed_size(count, self.bits)

    def encode_parts(self, x: torch.Tensor, draws: torch.Tensor | None) -> torch.Tensor:
        """``x[R, m]`` -> messages ``[R, part_bytes(m)]``, each row with its own norms."""
        assert draws is not None, "QSGD rounds at random: it needs draws"
        layout = segment_layout((x.shape[1],), self.bucket_size, x.device)
        norms, level, _ = self._quantise(x, draws, layout)
        codes = (level + self.levels).to(torch.uint8)
        # Codes are clamped to [0, 2 * levels] by _quantise: no range test (a host sync).
        return torch.cat([norms.view(torch.uint8),
                          pack_bits(codes, self.bits, checked=False)], dim=1)

    def decode_parts(self, messages: torch.Tensor, count: int) -> torch.Tensor:
        """Messages ``[R, part_bytes(count)]`` -> values ``[R, count]``."""
        head = 4 * self._layout(count)[0]
        codes = unpack_bits(messages[:, head:], self.bits, count)
        # Asserted on the device: a host read of the codes would stall a CUDA stream per call.
        _check_codes(codes, 2 * self.levels)
        return self._decode(reinterpret(messages[:, :head], torch.float32), codes, count)

    def part_draws(self, key: tuple[Any, ...], count: int, device: torch.device) -> torch.Tensor:
        """``count`` draws keyed by ``(seed, *key)`` (:func:`~gradzip.ops.segquant.keyed_draws`:
        integers, ``draws * UNIT`` uniform in ``[0, 1)``), made on ``device`` (the same bits on
        every device; never the global generator)."""
        layout = segment_layout((count,), 0, device)
        return keyed_draws([[key32("qsgd", self.seed, *key)]], layout, device)[0]

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
        offsets = _rank_sum(norms)  # [buckets]
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
        """Every worker's message of ``jobs`` all-gathered, each decoded and averaged; the
        whole call's encoding and decoding take a fixed number of ops (one per worker for
        the sum), whatever the number and sizes of its tensors."""
        if not jobs:
            return
        layout = segment_layout(tuple(job.numel for job in jobs), self.bucket_size,
                                jobs[0].tensor.device)
        x = join_rows([job.tensor for job in jobs], comm.local_workers)  # [L, total]
        decoded, averaged = self._gathered(x, layout, self._keys(jobs, ctx), comm)
        for job, part in zip(jobs, job_rows(jobs, decoded), strict=True):
            job.decoded = part
        if isinstance(averaged, torch.Tensor):
            give_averages(jobs, averaged)
            return
        for job, average in zip(jobs, averaged, strict=True):
            job.averaged = average.reshape(job.shape)

    def _gathered(
        self, x: torch.Tensor, layout: SegmentLayout, keys: list[list[int]], comm: Collective,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | list[torch.Tensor]]:
        """The tensors laid end to end in the rows of ``x[L, total]`` (in ``layout``'s
        buckets, drawn with ``keys``) sent as one message per worker (every bucket's norm,
        then all codes as one packed stream), all-gathered; returns ``(decoded, averaged)``:
        ``[L, total]`` what each local worker's own message decodes to, and the average of
        every worker's, ``[total]`` (written into ``out`` where given) or (on the CPU) one
        1-D tensor per tensor."""
        draws = keyed_draws(keys, layout, x.device)
        norms, level, decoded = self._quantise(x, draws, layout)
        # One message per call: every tensor's norms, then all codes as one packed stream.
        total = layout.total
        # Codes are clamped to [0, 2 * levels] by _quantise: no range test (a host sync).
        packed = pack_bits((level + self.levels).to(torch.uint8), self.bits, checked=False)
        gathered = comm.all_gather(torch.cat([norms.view(torch.uint8), packed], dim=1))
        # Every tensor's norms reinterpreted at once, then split (views).
        offset = 4 * layout.segments
        all_norms = reinterpret(gathered[:, :offset], torch.float32)  # [W, buckets]
        numels = layout.numels
        if total and cpu_form(gathered.device) and 2 <= self.bits <= 7 and _jit_usable():
            return decoded, self._average_compiled(numels, _per_tensor(all_norms, layout),
                                                   gathered[:, offset:], comm.world_size)
        codes = unpack_bits(gathered[:, offset:], self.bits, total)
        # Asserted on the device: a host read of the codes would stall a CUDA stream per call.
        _check_codes(codes, 2 * self.levels)
        if cpu_form(codes.device):  # the CPU's chunked sum, tensor by tensor
            out, start = [], 0
            for numel, norms_t in zip(numels, _per_tensor(all_norms, layout), strict=True):
                out.append(self._decode_sum(norms_t, codes[:, start : start + numel], numel,
                                            comm.world_size))
                start += numel
            return decoded, out
        return decoded, self._decode_sum_whole(all_norms, codes, layout, comm.world_size, out)

    def segment_plan(
        self, names: Sequence[str], sizes: Sequence[int], world_size: int, device: torch.device,
        shapes: Sequence[torch.Size] | None = None, *, state: Mapping[str, Any] | None = None,
    ) -> SegmentPlan | None:
        """The row's order (the all-gathered tensors, then those sent dense, each kind in
        the engine's order, as :meth:`reduce` groups them), their layout and names, where no
        tensor takes the sharded exchange (see
        :meth:`~gradzip.compressors.base.Compressor.segment_plan`); else ``None``."""
        def gathered(picked: list[int]) -> tuple[SegmentLayout, list[str]]:
            return (segment_layout(tuple(sizes[i] for i in picked), self.bucket_size, device),
                    [names[i] for i in picked])

        return gathered_or_dense_plan(
            [choose_exchange(self, self.exchange, n, world_size) for n in sizes], sizes, gathered)

    def reduce_segments(
        self, flat: torch.Tensor, plan: SegmentPlan, state: dict[str, Any], comm: Collective,
        ctx: StepContext, raw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`reduce` on tensors already laid end to end (see
        :meth:`~gradzip.compressors.base.Compressor.reduce_segments`): the dense tensors'
        all-reduce first, then the others' one message; the same draws and averages."""
        info, count = plan.data
        average = dense_tail(flat, count, comm)
        if info is not None:
            layout, names = info
            x = flat[:, :count]
            part = average[:count]
            decoded, averaged = self._gathered(x, layout, _keys_of(self.seed, names, ctx), comm,
                                               out=part)
            x.sub_(decoded)  # the residual, elementwise the engine's ``tensor - decoded``
            if not isinstance(averaged, torch.Tensor) and averaged:  # the CPU's, per tensor
                torch.cat(averaged, out=part)
        return average

    def _decode_sum_whole(
        self, norms: torch.Tensor, codes: torch.Tensor, layout: SegmentLayout, divisor: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`_decode_sum` of a whole call at once: (norms ``[R, buckets]``, codes
        ``[R, total]``) -> ``[total]``, each tensor's entries the bits :meth:`_decode_sum`
        gives for it alone (every entry sees the same operations: its rows' codes times
        their bucket's step added in rank order, its bucket's offset taken off, the division)."""
        steps = norms / self.levels  # [R, buckets]
        total = (torch.zeros(codes.shape[1], dtype=torch.float32, device=codes.device)
                 if out is None else out.zero_())
        for row in range(codes.shape[0]):
            total.addcmul_(codes[row], steps[row].index_select(0, layout.segment))
        offsets = _rank_sum(norms)  # [buckets]
        return total.sub_(offsets.index_select(0, layout.segment)).div_(divisor)

    def _average_compiled(
        self, numels: Sequence[int], all_norms: list[torch.Tensor], packed: torch.Tensor,
        world_size: int,
    ) -> list[torch.Tensor]:
        """The end of :meth:`reduce` through the compiled kernel: each tensor's average straight
        from the packed codes (no tensor of codes), the same bits as :meth:`_decode_sum`."""
        need = packed_size(sum(numels), self.bits)
        if packed.shape[1] < need:  # as unpack_bits refuses a truncated message
            raise ValueError(
                f"`packed` must hold at least {need} bytes for "
                f"{sum(numels)} codes of {self.bits} bits, got {packed.shape[1]}"
            )
        stream = packed.numpy()
        results, top, start = [], 0, 0
        for numel, norms in zip(numels, all_norms, strict=True):
            if numel == 0:  # the kernel wants at least one entry; an empty average
                results.append(np.zeros(0, dtype=np.float32))
                continue
            _, size = self._layout(numel)
            # The steps and offsets exactly as _decode_sum computes them.
            steps = (norms / self.levels).numpy()
            offsets = _rank_sum(norms).numpy()
            out, job_top = jit.qsgd_sum(
                stream, self.bits, start, numel, size, steps, offsets, world_size
            )
            results.append(out)
            top = max(top, job_top)
            start += numel
        if top > 2 * self.levels:
            raise ValueError(f"message codes must lie in [0, {2 * self.levels}], got {top}")
        return [torch.from_numpy(out) for out in results]


def _keys_of(seed: int, names: Sequence[str], ctx: StepContext) -> list[list[int]]:
    """Every local worker's noise key of every tensor: ``(seed, step, name, rank)``."""
    return [[key32("qsgd", seed, ctx.step, name, r) for name in names] for r in ctx.ranks]


def _rank_sum(norms: torch.Tensor) -> torch.Tensor:
    """``norms[R, buckets]`` summed over the rows, added in rank order (the same on every
    worker): the same bits for one tensor's buckets as for a whole call's, which a reduction
    kernel does not promise."""
    total = norms[0].clone()
    for row in range(1, norms.shape[0]):
        total += norms[row]
    return total


def _check_codes(codes: torch.Tensor, high: int) -> None:
    """:func:`~gradzip.ops.checks.check_range` for unsigned codes (never below 0): only their
    largest is compared, one reduction and one comparison on the device."""
    if codes.numel() == 0:
        return
    top = codes.max()
    check_on_device(top <= high, f"message codes must lie in [0, {high}]",
                    lambda: f"message codes must lie in [0, {high}], got {int(top)}")


def _per_tensor(norms: torch.Tensor, layout: SegmentLayout) -> list[torch.Tensor]:
    """``norms[R, buckets]`` split into each tensor's buckets (views)."""
    return list(torch.split(norms, list(layout.per_tensor), dim=1))


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
        (norms / q.levels).numpy(), _rank_sum(norms).numpy(), 3,
    )
    return bool(torch.equal(want.view(torch.int32), torch.from_numpy(got).view(torch.int32)))


def _jit_usable() -> bool:
    """The compiled decoder is enabled (:func:`gradzip.ops.jit.enabled`) and checked."""
    return jit.enabled() and _jit_checked()
