"""The engine's flat path: a DDP bucket of a stateless all-reduce compressor in one message.

A mixin of :class:`~gradzip.Engine` (it reads and writes the engine's attributes). For
``none``, ``fp16`` and ``bf16`` without error feedback or rules, a bucket's call on the host
path is: a finiteness test of every gradient, a concatenation into one message with the call
header appended, one all-reduce, a split, a finiteness test of the average, and a copy back
into the bucket. Here the same call works on a message preallocated once per bucket layout:
one copy in (in the engine's parameter order, divided and cast for fp16/bf16), one in-place
all-reduce, one copy out (divided for ``none``), and a whole-bucket ``aminmax`` before and
after instead of one per tensor. Everything the host path decides, it decides alike (the
same header, policies, log messages, byte counts, and the same bits in the bucket); every
other case takes the ordinary :meth:`~gradzip.Engine.reduce` (see
:meth:`~gradzip.Engine.reduce_bucket`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from gradzip.comm.base import allreduce_wire_bytes
from gradzip.comm.header import call_code, read_summed, rider_digit_bits, summed_row
from gradzip.compressors.lowprec import BF16, FP16
from gradzip.compressors.none import NoCompression
from gradzip.statecheck import copy_tree

__all__ = ["BucketLayout", "FlatPath"]

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


def _finite(x: torch.Tensor) -> bool:
    """Whether every entry of ``x`` is finite (one vectorised pass, one host read)."""
    if not x.numel():
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(x))).all())


class FlatPath:
    """The flat bucket call of :class:`~gradzip.Engine` (a mixin; see the module docstring)."""

    #: Whether :meth:`reduce_bucket` may take the flat path (tests turn it off on an
    #: instance to compare with the ordinary path).
    _flat_path = True

    def bucket_layout(self, named: Mapping[str, torch.Tensor], buffer: torch.Tensor) -> BucketLayout:
        """A bucket's layout for :meth:`reduce_bucket`: ``named`` checked as :meth:`reduce`
        checks gradients (build it again when the bucket's tensors change).

        Args:
            named: ``name -> gradient``, views into ``buffer``.
            buffer: the bucket's flat buffer.

        Raises:
            TypeError, ValueError: unknown names, wrong shapes or types.
        """
        checked = {n: self._as_worker_axis(n, g) for n, g in named.items()}  # type: ignore[attr-defined]
        names = sorted(named, key=lambda n: self._order[n])  # type: ignore[attr-defined]
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
        set_code = sum(self._name_codes[n] for n in names) % (1 << 64)  # type: ignore[attr-defined]
        return BucketLayout(dict(named), names, [checked[n] for n in names], views, sizes, buffer,
                            whole, set_code)

    def reduce_bucket(self, layout: BucketLayout, *, finish_step: bool,
                      step: int | None = None) -> None:
        """Average a DDP bucket's gradients in place: :meth:`reduce` with
        ``same_layout=True``, its averages written back into the bucket, bit for bit (the
        flat path where it applies, see the module docstring). Raises what :meth:`reduce`
        raises.

        Args:
            layout: from :meth:`bucket_layout`.
            finish_step: whether this call completes an optimizer step.
            step: the caller's step number, carried in the header (see :meth:`reduce`); the
                DDP hook passes its count of optimizer steps when it knows the optimizer.
        """
        if not self._flat_applies(layout):
            # The ordinary call, on the names and worker-axis views checked and ordered once.
            averaged = self._reduce_sorted(  # type: ignore[attr-defined]
                layout.names, layout.grads, layout.named, finish_step, step, True
            )
            for name, grad in layout.named.items():
                grad.copy_(averaged[name])
            return
        try:
            self._reduce_flat(layout, finish_step, step)
        except BaseException:
            self._abort_step()  # type: ignore[attr-defined]
            raise
        self._end_call(finish_step)  # type: ignore[attr-defined]

    def _flat_applies(self, layout: BucketLayout) -> bool:
        kind = _FLAT.get(type(self.compressor))  # type: ignore[attr-defined]
        if not self._flat_path:
            return False
        comm = self.comm  # type: ignore[attr-defined]
        if kind is None or self.rule_compressors or self._feedback:  # type: ignore[attr-defined]
            return False
        if comm.simulated or comm.local_workers != 1 or self._device_decisions:  # type: ignore[attr-defined]
            return False
        # A call after a non-finite one of a "skip" step sends the header alone, and device
        # flags must first be settled: the ordinary path does both.
        if self._poisoned or self._poison_dev is not None:  # type: ignore[attr-defined]
            return False
        if not layout.views:  # not plain fp32 CPU tensors (see bucket_layout)
            return False
        if any(n in self.dense_names for n in layout.names):  # type: ignore[attr-defined]
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

    def _reduce_flat(self, layout: BucketLayout, finish_step: bool, step: int | None) -> None:
        comm, world = self.comm, self.comm.world_size  # type: ignore[attr-defined]
        names, message, n = layout.names, layout.message, layout.numel
        assert message is not None
        _, prescale = _FLAT[type(self.compressor)]  # type: ignore[attr-defined]
        if not self._verified:  # type: ignore[attr-defined]
            self._verify_agreement()  # type: ignore[attr-defined]
        if self._snapshot is None:  # type: ignore[attr-defined]
            self._follow_loss_scale()  # type: ignore[attr-defined]
            self._snapshot = (copy_tree(self._states()), dict(self.residuals))  # type: ignore[attr-defined]
        before = (
            (copy_tree(self._states()), dict(self.residuals))  # type: ignore[attr-defined]
            if self.nonfinite == "zero" else self._snapshot  # type: ignore[attr-defined]
        )
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
        code = call_code(self.step, self._call, finish_step, step,  # type: ignore[attr-defined]
                         layout.set_code, len(names))
        message[n:] = torch.tensor(summed_row(code, layout.bits, bad), dtype=message.dtype)
        comm.all_reduce_(message)
        agreed, any_bad = read_summed([int(v) for v in message[n:].tolist()], world, layout.bits)
        if not agreed:
            self._out_of_step(names, finish_step, step)  # type: ignore[attr-defined]
        if any_bad:
            self._flat_policy(layout, before, finish_step, "a gradient holds NaN or Inf")
            return
        dense_bytes = 4 * n
        self.dense_payload[0] += dense_bytes  # type: ignore[attr-defined]
        self.dense_wire[0] += allreduce_wire_bytes(dense_bytes, world)  # type: ignore[attr-defined]
        # The sum is identical on every worker, so every worker takes the same decision; a
        # division by the world size keeps it finite or not. The state of a stateless
        # compressor cannot turn non-finite, but its end of step runs as on the host path.
        overflow = None
        if not _finite(message[:n]):
            first = next(name for name, part in zip(names, layout.parts, strict=True)
                         if not _finite(part))
            overflow = f"average.{first}"
        elif finish_step:
            overflow = self._end_step(before[0])  # type: ignore[attr-defined]
        if overflow is not None:
            self._flat_policy(layout, before, finish_step,
                              f"compression overflowed in {overflow}")
            return
        for view, part in zip(layout.views, layout.parts, strict=True):
            if prescale:
                view.copy_(part)  # the fp32 value of the low-precision sum
            else:
                torch.div(part, world, out=view)

    def _flat_policy(
        self, layout: BucketLayout, before: tuple[Any, dict[str, torch.Tensor]],
        finish_step: bool, what: str,
    ) -> None:
        filled = self._on_nonfinite(  # type: ignore[attr-defined]
            layout.names, layout.named, before, finish_step, what
        )
        for name, grad in layout.named.items():
            grad.copy_(filled[name])
