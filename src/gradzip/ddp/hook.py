"""The DDP comm hook itself, and the two ways to install it (``make_hook``, ``register``).

See :mod:`gradzip.ddp` for why the hook is shaped as it is.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradzip.compressors.base import Compressor
from gradzip.ddp.params import named_trainable_parameters
from gradzip.ddp.state import GradzipHookState
from gradzip.options import EngineOptions

__all__ = ["gradzip_hook", "make_hook", "register", "runs_inline"]

log = logging.getLogger("gradzip.ddp")


def runs_inline(backend: str, device: torch.device, device_decisions: bool) -> bool:
    """Whether a bucket's work runs inside the hook even with ``overlap=True``.

    On CUDA with NCCL every collective is already asynchronous on its own stream, and a
    compressor that decides on the device (``Compressor.device_decisions``) only enqueues
    kernels and collectives: the hook returns as soon as they are queued, so a thread would
    buy no overlap and add interpreter-lock contention with autograd. Everywhere else (gloo,
    whose collectives block the calling thread; a compressor that reads values on the host)
    the communication thread is what overlaps communication with the backward pass.

    Args:
        backend: the process group's backend, as ``torch.distributed.get_backend`` names it
            (``"nccl"``, ``"gloo"`` or a per-device list such as ``"cpu:gloo,cuda:nccl"``).
        device: where the parameters live.
        device_decisions: the compressor's ``device_decisions``.

    Returns:
        True to run inline (NCCL serves ``device``, which is CUDA, and the compressor decides
        on the device), False for the communication thread.
    """
    if device.type != "cuda" or not device_decisions:
        return False
    name = str(backend).lower()
    if ":" in name:  # one backend per device type
        per_device = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
        name = per_device.get("cuda", "")
    return name == "nccl"


def _inline(state: GradzipHookState) -> bool:
    """:func:`runs_inline` for this hook state (decided once: the group and device are fixed)."""
    if state._inline is None:
        device = next(iter(state.params.values())).device
        backend = dist.get_backend(state.process_group)
        state._inline = runs_inline(backend, device, state.compressor.device_decisions)
    return state._inline


def gradzip_hook(state: GradzipHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average one bucket's gradients through gradzip.

    Args:
        state: a :class:`GradzipHookState`.
        bucket: DDP's bucket of local (not yet averaged) gradients.

    Returns:
        A future holding the bucket's buffer, completed once that buffer holds the averaged
        gradients: at once with ``overlap=False`` or inline on NCCL (:func:`runs_inline`; the
        buffer's averages are then queued on the current CUDA stream, which DDP's later use
        of the buffer follows), by the communication thread otherwise; with
        ``fuse_buckets``, when the step's last bucket arrives (every bucket's at once).
    """
    if state._fused is not None:
        # DDP waits for the buckets' futures only once the backward pass has ended, after
        # the last bucket's hook: the earlier buckets' futures may stay open until then.
        return state._fused.take(state, bucket)
    if state.overlap and not _inline(state):
        return state._submit(bucket)
    # Collectives issued here, in bucket order, identical on every rank: see gradzip.ddp's
    # docstring for why nothing may wait inside a Future callback.
    engine = state.engine
    state._hook_thread = threading.get_ident()
    state._reduce_bucket(engine, state._layout(engine, bucket), bucket.is_last(),
                         state._optimizer_steps)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


# DDP checks the hook's annotations against the real types; postponed (string) annotations
# would fail that check.
gradzip_hook.__annotations__ = {
    "state": GradzipHookState,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def make_hook(
    model_or_named_params: nn.Module | Iterable[tuple[str, torch.Tensor]],
    compressor: Compressor | str,
    *,
    process_group: dist.ProcessGroup | None = None,
    overlap: bool = True,
    options: EngineOptions | None = None,
    fuse_buckets: bool = False,
    **engine_options: Any,
) -> tuple[GradzipHookState, Any]:
    """The ``(state, hook)`` pair that ``ddp_model.register_comm_hook(state, hook)`` and
    Lightning's ``DDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook)`` take.

    Args:
        model_or_named_params: the module DDP wraps (or the DDP model, or its
            ``(name, parameter)`` pairs).
        compressor: a :class:`~gradzip.Compressor` or spec string such as ``"powersgd:rank=2"``.
        process_group: see :class:`GradzipHookState`.
        overlap: see :class:`GradzipHookState`.
        options: an :class:`~gradzip.EngineOptions` record (its fields may also be given as
            keywords, which replace the record's).
        fuse_buckets: see :class:`GradzipHookState`.
        **engine_options: fields of :class:`~gradzip.EngineOptions` as keywords.

    Returns:
        ``(state, gradzip_hook)``.

    Raises:
        TypeError, ValueError: invalid arguments, naming the parameter.
    """
    state = GradzipHookState(
        named_trainable_parameters(model_or_named_params), compressor, process_group=process_group,
        overlap=overlap, options=EngineOptions.build(options, **engine_options),
        fuse_buckets=fuse_buckets,
    )
    return state, gradzip_hook


def register(
    ddp_model: DistributedDataParallel,
    compressor: Compressor | str,
    *,
    process_group: dist.ProcessGroup | None = None,
    overlap: bool = True,
    options: EngineOptions | None = None,
    fuse_buckets: bool = False,
    **engine_options: Any,
) -> GradzipHookState:
    """Register gradzip as ``ddp_model``'s communication hook (before the first backward).

    Args:
        ddp_model: a :class:`~torch.nn.parallel.DistributedDataParallel` model.
        compressor: a :class:`~gradzip.Compressor` or spec string such as ``"topk:ratio=0.01"``.
        process_group: defaults to the group ``ddp_model`` reduces over.
        overlap: see :class:`GradzipHookState`.
        options: an :class:`~gradzip.EngineOptions` record (its fields may also be given as
            keywords, which replace the record's).
        fuse_buckets: see :class:`GradzipHookState`.
        **engine_options: fields of :class:`~gradzip.EngineOptions` as keywords
            (``optimizer``, ``error_feedback``, ``nonfinite``, ``grad_scaler``, ``dense_1d``,
            ``rules``, ``min_numel``).

    Returns:
        The hook state: ``stats``, ``state_dict()`` (one file per rank), ``load_state_dict()``.

    Raises:
        TypeError, ValueError: invalid arguments, naming the parameter.
        RuntimeError: ``ddp_model`` already has a comm hook (raised by DDP).
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"`ddp_model` must be a torch.nn.parallel.DistributedDataParallel, "
            f"got {type(ddp_model).__name__}"
        )
    options = EngineOptions.build(options, **engine_options)
    if process_group is None:
        process_group = getattr(ddp_model, "process_group", None)
    state, hook = make_hook(
        ddp_model.module, compressor, process_group=process_group, overlap=overlap,
        options=options, fuse_buckets=fuse_buckets,
    )
    ddp_model.register_comm_hook(state, hook)
    log.debug("registered gradzip %s on %d parameters", state.compressor.spec(), len(state.params))
    return state
