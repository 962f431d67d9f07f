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

__all__ = ["gradzip_hook", "make_hook", "register"]

log = logging.getLogger("gradzip.ddp")


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
    # Synchronous collectives, in bucket order, identical on every rank: see gradzip.ddp's
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
