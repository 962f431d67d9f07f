"""One engine call per backward pass: a step's DDP buckets averaged together (``fuse_buckets``).

Why: much of what a compressor's hook costs on a GPU is fixed per call, not per byte: the call
header, the finiteness test, the compressor's whole-message ops, the collectives' launches and
the Python that issues them. DDP calls the hook once per bucket (four for a ResNet-18 at its
default 25 MB), so that fixed cost is paid four times a step. With ``fuse_buckets`` the hook
keeps each bucket until the last one of the backward pass arrives, copies all of them into
one flat buffer (one multi-tensor copy), lets the engine average that buffer in one call and
copies the averages back (one more), so the fixed cost is paid once.

What it costs: no overlap of communication with the backward pass (the exchange starts when
the last gradient is ready, as with one DDP bucket), and one gradient-sized buffer more. It
pays where the step is short and the link fast (a small model on a GPU, whose host time per
step the hook would otherwise set); a large model on a slow link wants the overlap.

The results are those of one engine call over every gradient, as the simulator's
:meth:`~gradzip.Engine.reduce` makes with one call per step, bit for bit; with one DDP bucket
they are the plain hook's. Buckets of different dtypes or devices cannot share one buffer:
they are then averaged one call each, in bucket order, as without fusing.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist

from gradzip.engine import BucketLayout

__all__ = ["FusedBuckets"]


class _Held:
    """One bucket kept until the last of the step: its buffer, key and future; its names and
    gradient views are read only when a layout is built (:meth:`views`)."""

    __slots__ = ("bucket", "buffer", "future", "key", "params", "state")

    def __init__(self, state: Any, bucket: dist.GradBucket) -> None:
        self.state, self.bucket = state, bucket
        self.buffer = bucket.buffer()
        self.params = bucket.parameters()
        self.key = (self.buffer.data_ptr(), self.buffer.numel(), tuple(map(id, self.params)))
        self.future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def views(self) -> tuple[list[str], list[torch.Tensor]]:
        """The bucket's parameter names and gradient views (into its buffer). Why not read
        at every bucket: a step whose buckets match the cached layout needs neither, and
        each costs a Python object per tensor."""
        return [self.state.name_of(p) for p in self.params], self.bucket.gradients()


class FusedBuckets:
    """The buckets of the backward pass in progress, and the fused layout of the last one.

    Attributes:
        held: the buckets received since the last one of a step.
    """

    def __init__(self) -> None:
        self.held: list[_Held] = []
        # (every bucket's key, the flat buffer, its per-bucket parts, the engine's layout),
        # rebuilt when DDP rebuilds its buckets (after the first iteration).
        self._fused: tuple[tuple[Any, ...], list[torch.Tensor], BucketLayout] | None = None
        # Bucket key -> the engine's layout of that bucket alone (buckets that cannot share one
        # buffer).
        self._apart: dict[Any, BucketLayout] = {}

    def take(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Keep ``bucket``; at the step's last bucket, average every kept one and complete
        their futures (``state``: the :class:`~gradzip.ddp.GradzipHookState`, which imports
        this module, hence untyped here). Raises what the engine raises (the futures of the
        earlier buckets then hold the error too)."""
        held = _Held(state, bucket)
        self.held.append(held)
        if not bucket.is_last():
            return held.future
        batch, self.held = self.held, []
        try:
            self._reduce(state, batch)
        except BaseException as exc:
            for item in batch[:-1]:
                item.future.set_exception(exc)
            raise
        for item in batch:
            item.future.set_result(item.buffer)
        return held.future

    def _reduce(self, state: Any, batch: list[_Held]) -> None:
        engine = state.engine
        state._hook_thread = threading.get_ident()
        step = state._optimizer_steps
        first = batch[0].buffer
        if any(b.buffer.dtype != first.dtype or b.buffer.device != first.device
               or b.buffer.dim() != 1 for b in batch):
            # Only this step's buckets' layouts are kept (each holds views of its buffer).
            self._apart = {item.key: self._apart_layout(engine, item) for item in batch}
            for i, item in enumerate(batch):  # one call each, the last finishing the step
                state._reduce_bucket(engine, self._apart[item.key], i == len(batch) - 1, step)
            return
        parts, layout = self._layout(engine, batch)
        buffers = [item.buffer for item in batch]
        torch._foreach_copy_(parts, buffers)
        state._reduce_bucket(engine, layout, True, step)
        torch._foreach_copy_(buffers, parts)

    def _layout(self, engine: Any, batch: list[_Held]) -> tuple[list[torch.Tensor], BucketLayout]:
        """The flat buffer's parts (one per bucket) and the engine's layout of the buffer,
        built once per set of buckets."""
        key = tuple(item.key for item in batch)
        if self._fused is not None and self._fused[0] == key:
            return self._fused[1], self._fused[2]
        sizes = [item.buffer.numel() for item in batch]
        first = batch[0].buffer
        flat = torch.empty(sum(sizes), dtype=first.dtype, device=first.device)
        parts = list(flat.split(sizes))
        named: dict[str, torch.Tensor] = {}
        for part, item in zip(parts, batch, strict=True):
            base = item.buffer.storage_offset()
            names, grads = item.views()
            for name, grad in zip(names, grads, strict=True):
                # The gradient's place in its bucket is its place in that bucket's part.
                start = grad.storage_offset() - base
                named[name] = part[start:start + grad.numel()].view(grad.shape)
        layout = engine.bucket_layout(named, flat)
        self._fused = (key, parts, layout)
        return parts, layout

    def _apart_layout(self, engine: Any, item: _Held) -> BucketLayout:
        layout = self._apart.get(item.key)
        if layout is None:
            layout = engine.bucket_layout(dict(zip(*item.views(), strict=True)), item.buffer)
            self._apart[item.key] = layout
        return layout
