"""DistributedDataParallel communication hook: gradzip's engine behind DDP's buckets.

A thin adapter. DDP hands the hook one *bucket* (a flat buffer holding several parameters'
local gradients) at a time; the hook looks the parameters up by name, lets one
:class:`~gradzip.Engine` average them through the compressor, writes the averages back into
the bucket's buffer and completes the future it returned. By default (``overlap=True``) that
work runs on a communication thread while autograd computes the later buckets, as native DDP
overlaps its all-reduces; ``overlap=False`` runs it inside the hook (the baseline, and the
simplest to debug). Both give the same results bit for bit.

Why it is shaped this way (each point is a failure of hooks keyed differently):

* **State is keyed by parameter name, never by bucket index.** DDP rebuilds its buckets after
  the first iteration (and their number depends on ``bucket_cap_mb``), so bucket indices do
  not name the same tensors from one iteration to the next. Keyed by name, compression works
  from the very first step, across the rebuild, and a restored state works on the first step
  after resume.
* **Collectives are issued in bucket order, from one queue**, identical on every rank (DDP
  launches buckets in index order). Nothing is issued from, or waits inside, a
  ``Future.then()`` callback: PyTorch's ``powerSGD_hook``, which chains its all-reduces that
  way, deadlocks on gloo at its first compressed step once there are two or more buckets.
  With ``overlap=True`` one thread per process runs the buckets' work in arrival order on a
  private copy of the process group (see :mod:`gradzip._ddp_thread` for why a copy); with
  ``overlap=False`` the hook runs it itself, on DDP's group.
* **Errors reach every rank.** An exception in a bucket's work completes that bucket's future
  with it, so DDP raises it at the end of the backward pass; later buckets of the same hook
  state then fail at once without issuing collectives (the ranks' sequences no longer
  match). A rank whose peer failed sees its own collective fail when the peer's process
  exits, or at the process group's timeout; it never waits forever.
* **Reading state waits for the work in flight**: ``stats``, ``state_dict()`` and
  ``load_state_dict()`` first wait for every queued bucket.
* **One optimizer step per backward.** The last bucket of a backward (``bucket.is_last()``)
  finishes the engine's step; micro-batches under ``ddp_model.no_sync()`` never reach the hook,
  so ``stats["steps"]`` counts optimizer steps under gradient accumulation.
* **Non-finite gradients** (``nonfinite="skip"``, the default): every rank agrees that some
  gradient holds NaN/Inf (a count in the bucket's header), all compression state rolls back to
  where the step began and the bucket is filled with NaN, so a ``GradScaler`` (or any finite
  check) skips the step. On CUDA, with ``none``, ``fp16``, ``bf16``, ``randk`` or
  ``powersgd``, that decision stays on the device (``torch.where``, no host read per
  bucket); the headers' agreement is read once per step, at the last bucket.

Byte counts in :attr:`GradzipHookState.stats` (cumulative, for this rank):

* ``payload_bytes``: the bytes of every message this rank contributed to a collective
  (compressed values, indices, sizes exchanged before a padded all-gather, PowerSGD's ``P`` and
  ``Q`` factors and the tensors sent dense beside them, and each bucket's call header: a few
  elements appended to the bucket's first collective, since DDP guarantees every rank the same
  buckets (see :mod:`gradzip.comm.header`), so ``none``, ``fp16`` and ``bf16`` make one
  collective per bucket). The one-off configuration handshake before the first step is
  counted apart, in ``handshake_bytes``.
* ``wire_bytes``: what a ring algorithm makes this rank send for those messages
  (``2 (W-1)/W`` times the message for an all-reduce, ``(W-1)`` times the padded message for
  an all-gather).
* ``dense_payload_bytes`` / ``dense_wire_bytes``: the same for the uncompressed fp32
  all-reduce of every gradient DDP would do without a hook.

For comparison, PyTorch's built-in ``powerSGD_hook`` all-reduces, per step, the full bucket
during its ``start_powerSGD_iter`` warm-up iterations, then three fp32 buffers: the
uncompressed tensors (1-D ones and those low rank would not shrink enough), all ``P`` factors
and all ``Q`` factors. gradzip's PowerSGD sends the same ``P`` and ``Q`` (the dense tensors ride
in the ``P`` buffer) from the first step on.

Examples:
    >>> ddp_model = DistributedDataParallel(model)
    >>> state = gradzip.ddp.register(ddp_model, "powersgd:rank=2", optimizer=optimizer)
    >>> ...train...; torch.save(state.state_dict(), f"gradzip-rank{rank}.pt")
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
from gradzip.ddp_params import named_trainable_parameters
from gradzip.ddp_state import GatheredState, GradzipHookState
from gradzip.options import EngineOptions

__all__ = ["GatheredState", "GradzipHookState", "gradzip_hook", "make_hook", "register"]

log = logging.getLogger(__name__)


def gradzip_hook(state: GradzipHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average one bucket's gradients through gradzip.

    Args:
        state: a :class:`GradzipHookState`.
        bucket: DDP's bucket of local (not yet averaged) gradients.

    Returns:
        A future holding the bucket's buffer, completed once that buffer holds the averaged
        gradients: at once with ``overlap=False``, by the communication thread otherwise.
    """
    if state.overlap:
        return state._submit(bucket)
    # Synchronous collectives, in bucket order, identical on every rank: see the module
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
        **engine_options: fields of :class:`~gradzip.EngineOptions` as keywords.

    Returns:
        ``(state, gradzip_hook)``.

    Raises:
        TypeError, ValueError: invalid arguments, naming the parameter.
    """
    state = GradzipHookState(
        named_trainable_parameters(model_or_named_params), compressor, process_group=process_group,
        overlap=overlap, options=EngineOptions.build(options, **engine_options),
    )
    return state, gradzip_hook


def register(
    ddp_model: DistributedDataParallel,
    compressor: Compressor | str,
    *,
    process_group: dist.ProcessGroup | None = None,
    overlap: bool = True,
    options: EngineOptions | None = None,
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
        options=options,
    )
    ddp_model.register_comm_hook(state, hook)
    log.debug("registered gradzip %s on %d parameters", state.compressor.spec(), len(state.params))
    return state
