"""The engine's flat path: a DDP bucket of a stateless all-reduce compressor in one message.

For ``none``, ``fp16`` and ``bf16`` without error feedback or rules, a bucket's call on the host
path is: a finiteness test of every gradient, a concatenation into one message with the call
header appended, one all-reduce, a split, a finiteness test of the average, and a copy back
into the bucket. Here the same call works on a message preallocated once per bucket layout:
one copy in (in the engine's parameter order, divided and cast for fp16/bf16), one in-place
all-reduce, one copy out (divided for ``none``), and a whole-bucket ``aminmax`` before and
after instead of one per tensor. Everything the host path decides, it decides alike (the
same header, policies, log messages, byte counts, and the same bits in the bucket); every
other case takes the ordinary :meth:`~gradzip.Engine.reduce` (see
:meth:`~gradzip.Engine.reduce_bucket`), and so does every bucket with ``decide_on`` other than
``"auto"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

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
from gradzip.engine.policy import NonfinitePolicy
from gradzip.engine.step import Saved, Step

__all__ = ["BucketLayout", "bucket_layout", "flat_applies", "reduce_flat"]

#: Compressor type -> (message dtype, whether each gradient is divided by the world size
#: before the sum). Exact types: a subclass may reduce differently.
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
            contiguous fp32 CPU tensors: then only the ordinary path applies).
        sizes: their element counts.
        buffer: the bucket's flat buffer.
        whole: whether ``views`` tile ``buffer`` exactly (one ``aminmax`` tests them all).
        set_code: the names' part of the call code (see :mod:`gradzip.comm.header`).
    """

    named: dict[str, torch.Tensor]
    names: list[str]
    grads: list[torch.Tensor]
    views: list[torch.Tensor]
    sizes: list[int]
    buffer: torch.Tensor
    whole: bool
    set_code: int
    #: The preallocated message and its per-tensor slices (built on the first flat call).
    message: torch.Tensor | None = None
    parts: list[torch.Tensor] = field(default_factory=list)
    bits: int = 0

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    def call(self, finish_step: bool, step: int | None = None) -> Call:
        """The bucket's call (the header rides: DDP hands every rank the same buckets);
        ``step``: the caller's step number for the header, or ``None``."""
        return Call(self.names, self.grads, self.named, finish_step, step, True)


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
    # The flat path writes into these views: only plain fp32 CPU tensors qualify.
    eligible = all(named[n].is_contiguous() and named[n].dtype == torch.float32
                   and named[n].device.type == "cpu" for n in names)
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
                        whole, set_code(engine, names))


def flat_applies(engine: EngineBase, step: Step, layout: BucketLayout) -> bool:
    """Whether the bucket's call may take the flat path (building its message once)."""
    kind = _FLAT.get(type(engine.compressor))
    if engine.decide_on != "auto":
        return False
    comm = engine.comm
    if kind is None or engine.rule_compressors or engine._feedback:
        return False
    if comm.simulated or comm.local_workers != 1:
        return False
    # A call after a non-finite one of a "skip" step sends the header alone, and device
    # flags must first be settled: the ordinary path does both.
    if step.poisoned or step.poison_dev is not None:
        return False
    if not layout.views:  # not plain fp32 CPU tensors (see bucket_layout)
        return False
    if any(n in engine.dense_names for n in layout.names):
        return False  # a second message (the dense tensors'): the ordinary path
    if layout.message is None:
        dtype, _ = kind
        bits = rider_digit_bits(dtype, comm.world_size, summed=True)
        if bits is None:
            return False  # the header cannot ride: sent apart, the ordinary path
        extra = len(summed_row(0, bits, False))
        layout.message = torch.empty(layout.numel + extra, dtype=dtype)
        layout.parts = list(torch.split(layout.message[: layout.numel], layout.sizes))
        layout.bits = bits
    return True


def reduce_flat(
    engine: EngineBase, step: Step, policy: NonfinitePolicy, call: Call, layout: BucketLayout,
    before: Saved,
) -> None:
    """The bucket's call as one message (:func:`flat_applies`), its averages written into
    the bucket.

    Args:
        engine, step, policy: the engine, its step in progress and its non-finite policy.
        call: the bucket's call (:meth:`BucketLayout.call`).
        layout: the bucket's layout.
        before: what the policy restores (:meth:`NonfinitePolicy.restore_point`).
    """
    world = engine.comm.world_size
    names, message, n = layout.names, layout.message, layout.numel
    assert message is not None
    _, prescale = _FLAT[type(engine.compressor)]
    # The gradients as they came (no residual: no error feedback here).
    bad = not (_finite(layout.buffer) if layout.whole
               else all(_finite(v) for v in layout.views))
    if prescale:  # divide before summing in low precision; computed in fp32, then cast
        for view, part in zip(layout.views, layout.parts, strict=True):
            torch.div(view, world, out=part)
    else:
        torch.cat(layout.views, out=message[:n])
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
    for view, part in zip(layout.views, layout.parts, strict=True):
        if prescale:
            view.copy_(part)  # the fp32 value of the low-precision sum
        else:
            torch.div(part, world, out=view)


def _write(layout: BucketLayout, values: Mapping[str, torch.Tensor]) -> None:
    """Copy a call's results into the bucket's gradients."""
    for name, grad in layout.named.items():
        grad.copy_(values[name])
