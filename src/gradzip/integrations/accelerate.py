"""gradzip for Hugging Face Accelerate: one call after ``accelerator.prepare``.

Accelerate's own route, ``DistributedDataParallelKwargs(comm_hook=...)``, accepts only
PyTorch's fixed list of hooks. :func:`register` puts gradzip's hook on the DDP model that
``prepare`` returned and registers its state for ``save_state``/``load_state``.

Examples:
    >>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    >>> state = gradzip.integrations.accelerate.register(accelerator, model, "powersgd:rank=2")
    >>> ...; accelerator.save_state("ckpt")   # every rank's residuals, in one file
"""

from __future__ import annotations

import logging
from typing import Any

try:
    from accelerate import Accelerator
except ImportError as _error:  # pragma: no cover - exercised without accelerate installed
    from gradzip.integrations._common import missing_framework

    raise missing_framework("gradzip.integrations.accelerate", "accelerate", _error) from _error

from torch.nn.parallel import DistributedDataParallel

import gradzip.ddp
from gradzip.compressors.base import Compressor
from gradzip.integrations._common import with_optimizer

__all__ = ["register"]

log = logging.getLogger(__name__)


def register(
    accelerator: Accelerator, model: Any, compressor: Compressor | str, **engine_options: Any
) -> gradzip.ddp.GradzipHookState:
    """Register gradzip as the communication hook of a prepared model, and its state for
    checkpointing.

    Call it after ``accelerator.prepare`` and before the first backward. The state is
    registered with ``accelerator.register_for_checkpointing`` as
    :meth:`~gradzip.ddp.GradzipHookState.gathered`: Accelerate saves custom objects from the
    main process only, so every rank's state (error-feedback residuals differ per rank) is
    gathered into that one file, and ``load_state`` gives each rank its own entry back.
    ``save_state`` and ``load_state`` must then run on every rank, as Accelerate requires.

    Args:
        accelerator: the :class:`accelerate.Accelerator` that prepared ``model``.
        model: the ``DistributedDataParallel`` model ``accelerator.prepare`` returned (it is
            one with 2 or more processes on one device each).
        compressor: a :class:`~gradzip.Compressor` or spec string such as ``"topk:ratio=0.01"``.
        **engine_options: the keywords of :func:`gradzip.ddp.register`: the fields of
            :class:`~gradzip.EngineOptions` (``error_feedback``, ``nonfinite``,
            ``grad_scaler``, ``dense_1d``, ``rules``, ``min_numel``, ...), an ``options``
            record, ``overlap``, ``fuse_buckets``. ``optimizer`` (read for the learning rate)
            defaults to the one optimizer ``accelerator`` prepared, if one.

    Returns:
        The hook state (``stats``, ``state_dict()``).

    Raises:
        TypeError: ``accelerator`` is not an ``Accelerator``, or ``model`` not a DDP model.
        ValueError: invalid engine options (named by :func:`gradzip.ddp.register`).
    """
    if not isinstance(accelerator, Accelerator):
        raise TypeError(
            f"`accelerator` must be an accelerate.Accelerator, got {type(accelerator).__name__}"
        )
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            "`model` must be the DistributedDataParallel model accelerator.prepare returned "
            f"(run with 2 or more processes, e.g. `accelerate launch`), got {type(model).__name__} "
            f"with {accelerator.num_processes} process(es)"
        )
    # Accelerate keeps the optimizers it prepared; with exactly one, it is this model's.
    prepared = list(getattr(accelerator, "_optimizers", []))
    engine_options = with_optimizer(engine_options, prepared[0] if len(prepared) == 1 else None)
    state = gradzip.ddp.register(model, compressor, **engine_options)
    accelerator.register_for_checkpointing(state.gathered())
    log.debug("gradzip %s registered for Accelerate checkpoints", state.compressor.spec())
    return state
