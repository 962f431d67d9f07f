"""The engine's flat path: a DDP bucket of a stateless all-reduce compressor in one message.

For ``none``, ``fp16`` and ``bf16`` without error feedback, rules or dense tensors, a bucket's
call works on a message preallocated once per bucket layout: the gradients copied in (in the
engine's parameter order, divided and cast for fp16/bf16) with the call header appended, one
in-place all-reduce, the average copied out (divided for ``none``). Gradients that sit next to
each other both in the bucket and in the engine's order move as one *run* (one copy), so a
bucket costs a few ops, not a few per tensor. Two forms, as for the ordinary path:

* the **host form** (:func:`reduce_flat`, on the CPU and with ``nonfinite="raise"``): one
  whole-bucket finiteness test before and after, read on the host, and the policy's host form;
* the **device form** (:func:`reduce_flat_on_device`, what CUDA tensors take, and any device
  with ``decide_on="device"``): nothing is read on the host; the header's agreement is kept as
  a 0-d flag and read once per step at its last bucket, the non-finite decision is a 0-d flag
  and the policy's device form masks the average (see :mod:`gradzip.engine.device`).

Both decide what the ordinary path decides (the same header, policies, byte counts, and the
same bits in the bucket; the host form logs alike too). Every other case takes the ordinary
:meth:`~gradzip.Engine.reduce` (see :meth:`~gradzip.Engine.reduce_bucket`), and so does every
bucket with ``decide_on="host"`` (the reference the flat path is tested against).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy
import torch

from gradzip.comm.header import read_summed, rider_digit_bits, summed_row
from gradzip.compressors.lowprec import BF16, FP16
from gradzip.compressors.none import NoCompression
from gradzip.engine.base import EngineBase
from gradzip.engine.call import (
    Call,
    code_of,
    count_dense,
    end_compressors_step,
    out_of_step,
    set_code,
)
from gradzip.engine.deferred import any_nonfinite
from gradzip.engine.device import finish_on_device
from gradzip.engine.policy import NonfinitePolicy
from gradzip.engine.step import Saved, Step, or_flag
from gradzip.ops.flat import to_device

__all__ = ["BucketLayout", "bucket_layout", "flat_applies", "reduce_flat",
           "reduce_flat_on_device"]

#: Compressor type -> (message dtype, whether each gradient is divided by the world size
#: before the all-reduce). Exactly the compressors whose ordinary ``reduce`` is one
#: all-reduce of the concatenated (divided, cast) gradients; subclasses may reduce differently.
_FLAT = {NoCompression: (torch.float32, False), FP16: (torch.float16, True),
         BF16: (torch.bfloat16, True)}



@dataclass(eq=False)
class BucketLayout:
    """One DDP bucket as the engine sees it, built once per bucket layout and reused.

    Attributes:
        named: ``name -> gradient`` (views into ``buffer``, in the bucket's order).
        names: the same names in the engine's parameter order (the message's layout).
        grads: the gradients with their worker axis, in ``names`` order.
        views: the gradients' flat views, in ``names`` order (empty where they are not all
            contiguous fp32 tensors on the buffer's device: then only the ordinary path
            applies).
        sizes: their element counts.
        buffer: the bucket's flat buffer.
        whole: whether ``views`` tile ``buffer`` exactly (one ``aminmax`` tests them all).
        set_code: the names' part of the call code (see :mod:`gradzip.comm.header`).
        runs: ``(source, start)`` per run of views adjacent both in memory and in ``names``
            order: ``source`` a flat view of their memory, ``start`` its offset in the
            message.
    """

    named: dict[str, torch.Tensor]
    names: list[str]
    grads: list[torch.Tensor]
    views: list[torch.Tensor]
    sizes: list[int]
    buffer: torch.Tensor
    whole: bool
    set_code: int
    runs: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    #: The preallocated message and its per-tensor slices (built on the first flat call).
    message: torch.Tensor | None = None
    parts: list[torch.Tensor] = field(default_factory=list)
    bits: int = 0
    #: :meth:`pairs`, made once per message (the slices are views: the message and the
    #: runs' memory persist, so one set serves every call).
    _pairs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    _pairs_of: torch.Tensor | None = None
    #: The segment path's form of this bucket (:class:`~gradzip.engine.segments.Segments`),
    #: built on its first call there.
    segments: Any = None

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    def call(self, finish_step: bool, step: int | None = None) -> Call:
        """The bucket's call (the header rides: DDP hands every rank the same buckets);
        ``step``: the caller's step number for the header, or ``None``."""
        return Call(self.names, self.grads, self.named, finish_step, step, True)

    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(source, message slice)`` per run (the message must exist)."""
        assert self.message is not None
        if self._pairs_of is not self.message:
            # Why cached: a bucket's call runs this twice (in and out), every step, with a
            # slice per run; the views stay valid as long as the message does.
            self._pairs = [(src, self.message[start : start + src.numel()])
                           for src, start in self.runs]
            self._pairs_of = self.message
        return self._pairs


def _runs(views: list[torch.Tensor]) -> list[tuple[torch.Tensor, int]]:
    """Merge views (in message order) that follow each other in the same storage."""
    runs: list[tuple[torch.Tensor, int, int, int]] = []  # (first view, offset, size, start)
    start = 0
    for view in views:
        offset, size = view.storage_offset(), view.numel()
        if runs:
            first, at, length, begin = runs[-1]
            if (first.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()
                    and at + length == offset):
                runs[-1] = (first, at, length + size, begin)
                start += size
                continue
        runs.append((view, offset, size, start))
        start += size
    return [(first.as_strided((length,), (1,), at), begin) for first, at, length, begin in runs]


def _finite(x: torch.Tensor) -> bool:
    """Whether every entry of ``x`` is finite (one vectorised pass, one host read)."""
    if not x.numel():
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(x))).all())


def bucket_layout(
    engine: EngineBase, named: Mapping[str, torch.Tensor], buffer: torch.Tensor
) -> BucketLayout:
    """A bucket's layout: ``named`` checked as :meth:`~gradzip.Engine.reduce` checks
    gradients (build it again when the bucket's tensors change).

    Args:
        engine: the engine.
        named: ``name -> gradient``, views into ``buffer``.
        buffer: the bucket's flat buffer.

    Returns:
        The layout.

    Raises:
        TypeError, ValueError: unknown names, wrong shapes or types.
    """
    checked = {n: engine._as_worker_axis(n, g) for n, g in named.items()}
    names = sorted(named, key=lambda n: engine._order[n])
    # The flat path writes into these views: only plain fp32 tensors on the buffer's device.
    eligible = all(named[n].is_contiguous() and named[n].dtype == torch.float32
                   and named[n].device == buffer.device for n in names)
    views = [named[n].view(-1) for n in names] if eligible else []
    sizes = [named[n].numel() for n in names]
    starts = sorted(
        (v.storage_offset(), v.numel()) for v in views
        if v.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    )
    cursor, whole = buffer.storage_offset(), eligible and len(starts) == len(views)
    for start, size in starts:
        whole, cursor = whole and start == cursor, start + size
    whole = (whole and buffer.dim() == 1 and buffer.dtype == torch.float32
             and cursor == buffer.storage_offset() + buffer.numel())
    return BucketLayout(dict(named), names, [checked[n] for n in names], views, sizes, buffer,
                        whole, set_code(engine, names), _runs(views))


def flat_applies(engine: EngineBase, step: Step, layout: BucketLayout) -> bool:
    """Whether the bucket's call may take the flat path, in either form (building its
    message once); the host form also needs no device decision pending in the step."""
    kind = _FLAT.get(type(engine.compressor))
    if engine.decide_on == "host":
        return False
    comm = engine.comm
    if kind is None or engine.rule_compressors or engine._feedback:
        return False
    if comm.simulated or comm.local_workers != 1:
        return False
    # A call after a non-finite one of a "skip" step decided on the host sends the header
    # alone: the ordinary path does that.
    if step.poisoned:
        return False
    if not layout.views:  # not plain fp32 tensors (see bucket_layout)
        return False
    if any(n in engine.dense_names for n in layout.names):
        return False  # a second message (the dense tensors'): the ordinary path
    if layout.message is None:
        dtype, _ = kind
        bits = rider_digit_bits(dtype, comm.world_size, summed=True)
        if bits is None:
            return False  # the header cannot ride: sent apart, the ordinary path
        extra = len(summed_row(0, bits, False))
        layout.message = torch.empty(layout.numel + extra, dtype=dtype,
                                     device=layout.buffer.device)
        layout.parts = list(torch.split(layout.message[: layout.numel], layout.sizes))
        layout.bits = bits
    return True


def _header_row(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    """The header's small integers as a CPU tensor of the message's ``dtype``, made by numpy
    (no op of its own). bfloat16, which numpy lacks, is the upper half of float32's bits:
    exact for these integers (every header value fits in bfloat16's 8-bit significand, see
    :func:`~gradzip.comm.header.rider_digit_bits`)."""
    if dtype == torch.bfloat16:
        bits = numpy.asarray(values, numpy.float32).view(numpy.uint32) >> 16
        return torch.from_numpy(bits.astype(numpy.uint16)).view(torch.bfloat16)
    return torch.from_numpy(numpy.asarray(values, {torch.float16: numpy.float16}.get(
        dtype, numpy.float32)))


def _copy_in(layout: BucketLayout, world: int, prescale: bool,
             header: torch.Tensor | None = None) -> None:
    """The gradients into the message, in the engine's order (divided and cast for a
    low-precision message: computed in fp32, then cast, as the ordinary path does); with
    ``header`` (on the message's device, in its dtype), the header into its tail by the same
    multi-tensor copy where there is one."""
    pairs = layout.pairs()
    sources, parts = [src for src, _ in pairs], [part for _, part in pairs]
    tail = []
    if header is not None:
        assert layout.message is not None
        tail = [(layout.message[layout.numel :], header)]
    if len(pairs) == 1 and prescale:
        torch.div(sources[0], world, out=parts[0])
        for dst, src in tail:
            dst.copy_(src)
        return
    # DDP orders a bucket by when its gradients became ready, the message follows the
    # engine's parameter order (see Engine.reduce), so a bucket is often many runs: one
    # multi-tensor copy moves them all, and the header with them (one launch on CUDA,
    # elementwise the same as a copy per run).
    if prescale and layout.whole:
        # The whole bucket divided and cast in one op (into a bucket-ordered scratch of the
        # message's dtype), then the runs moved: the same rounding as run by run.
        scaled = torch.div(layout.buffer, world, out=torch.empty_like(layout.buffer,
                                                                     dtype=parts[0].dtype))
        base = layout.buffer.storage_offset()
        sources = [scaled[src.storage_offset() - base :][: src.numel()] for src in sources]
    elif prescale:
        sources = torch._foreach_div(sources, world)
    torch._foreach_copy_(parts + [d for d, _ in tail], [*sources, *(h for _, h in tail)])


def _copy_out(layout: BucketLayout) -> None:
    """The message (its average, in place) back into the bucket (cast to fp32 from a
    low-precision message, elementwise as the ordinary path's ``.to(torch.float32)``)."""
    pairs = layout.pairs()
    if len(pairs) == 1:
        pairs[0][0].copy_(pairs[0][1])
        return
    torch._foreach_copy_([src for src, _ in pairs], [part for _, part in pairs])


def reduce_flat(
    engine: EngineBase, step: Step, policy: NonfinitePolicy, call: Call, layout: BucketLayout,
    before: Saved,
) -> None:
    """The bucket's call as one message, its decisions read on the host (see the module
    docstring), its averages written into the bucket.

    Args:
        engine, step, policy: the engine, its step in progress and its non-finite policy.
        call: the bucket's call (:meth:`BucketLayout.call`).
        layout: the bucket's layout (:func:`flat_applies` said yes).
        before: what the policy restores (:meth:`NonfinitePolicy.restore_point`).
    """
    world = engine.comm.world_size
    names, message, n = layout.names, layout.message, layout.numel
    assert message is not None
    _, prescale = _FLAT[type(engine.compressor)]
    # The gradients as they came (no residual: no error feedback here).
    bad = not (_finite(layout.buffer) if layout.whole
               else all(_finite(src) for src, _ in layout.runs))
    _copy_in(layout, world, prescale)
    if bad:
        # As on the host path: a non-finite worker sends zeros (the result is discarded
        # by the policy on every worker alike; zeros keep the message's size).
        message[:n].zero_()
    code = code_of(engine, step, call, layout.set_code)
    message[n:] = torch.tensor(summed_row(code, layout.bits, bad), dtype=message.dtype)
    engine.comm.all_reduce_(message)
    agreed, any_bad = read_summed([int(v) for v in message[n:].tolist()], world, layout.bits)
    if not agreed:
        out_of_step(engine, step, call)
    if any_bad:
        _write(layout, policy.on_host(engine, step, call, before, "a gradient holds NaN or Inf"))
        return
    count_dense(engine, n)
    # The sum is identical on every worker, so every worker takes the same decision; a
    # division by the world size keeps it finite or not. The state of a stateless
    # compressor cannot turn non-finite, but its end of step runs as on the host path.
    overflow = None
    if not _finite(message[:n]):
        first = next(name for name, part in zip(names, layout.parts, strict=True)
                     if not _finite(part))
        overflow = f"average.{first}"
    elif call.finish_step:
        overflow = end_compressors_step(engine, before.states)
    if overflow is not None:
        _write(layout, policy.on_host(engine, step, call, before,
                                      f"compression overflowed in {overflow}"))
        return
    if not prescale:
        message[:n].div_(world)  # the ordinary path's ``sum / world``, elementwise alike
    _copy_out(layout)


def _disagree(tail: torch.Tensor, world: int, bits: int) -> torch.Tensor:
    """0-d bool, on the device: whether the summed header digits of ``tail`` (the message's
    header part, see :func:`~gradzip.comm.header.read_summed`) show ranks with different
    codes. In float64 every sum and product here is exact (see
    :mod:`gradzip.comm.header`)."""
    sums = tail.to(torch.float64)
    every = 2 if bits > 1 else 1
    first, squares = sums[0:-1:every], sums[every - 1 : -1 : every]
    return ~(world * squares == first * first).all()


def reduce_flat_on_device(
    engine: EngineBase, step: Step, policy: NonfinitePolicy, call: Call, layout: BucketLayout,
    before: Saved,
) -> None:
    """The bucket's call as one message with its decisions kept on the device (see the
    module docstring; where it applies: :func:`~gradzip.engine.device.decides_on_device`),
    its averages written into the bucket: the same bits, state and counters as the ordinary
    device path, without a host read.

    Args: as :func:`reduce_flat`.
    """
    comm = engine.comm
    world = comm.world_size
    message, n = layout.message, layout.numel
    assert message is not None
    _, prescale = _FLAT[type(engine.compressor)]
    device = message.device
    # No finiteness test of the gradients before sending: a NaN or Inf on any worker makes
    # that element of the sum non-finite on every worker (it is never zeroed here, unlike
    # on the host form, as the ordinary device path does not zero it either), so the test
    # of the average below decides for every worker alike. The header's non-finite slot
    # stays 0; the policy acts the same whichever test finds it.
    code = code_of(engine, step, call, layout.set_code)
    # Made by numpy, not torch.tensor: no op of its own (the values are small integers,
    # exact in every message dtype, see gradzip.comm.header); in the message's dtype where
    # numpy has it, so it joins the gradients' multi-tensor copy.
    header = to_device(_header_row(summed_row(code, layout.bits, False), message.dtype), device)
    _copy_in(layout, world, prescale, header)
    comm.all_reduce_(message)
    if world > 1:
        # Ranks out of step exchange messages of equal sizes here (the bucket's layout is
        # the same on every rank), so nothing aborts: read once, at the step's end.
        step.desync_dev = or_flag(step.desync_dev, _disagree(message[n:], world, layout.bits))
    count_dense(engine, n)
    average = message[:n]
    if not prescale:
        average.div_(world)  # the same rounding as the ordinary path's sum / world
    flag = any_nonfinite([average], device)
    mask, fill = policy.on_device(engine, step, [], before, flag)
    average.masked_fill_(mask, fill)
    if call.finish_step:
        finish_on_device(engine, step, policy, device)
    _copy_out(layout)


def _write(layout: BucketLayout, values: Mapping[str, torch.Tensor]) -> None:
    """Copy a call's results into the bucket's gradients."""
    for name, grad in layout.named.items():
        grad.copy_(values[name])
