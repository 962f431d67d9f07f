"""gradzip for the Hugging Face ``Trainer``: one callback.

The Trainer has no communication-hook setting. :class:`GradzipCallback` registers gradzip's
hook on the ``DistributedDataParallel`` model the Trainer builds when training begins, writes
every rank's hook state into each checkpoint folder and reads it back on
``trainer.train(resume_from_checkpoint=...)``.

Examples:
    >>> from gradzip.integrations.transformers import GradzipCallback
    >>> trainer = Trainer(model, args, train_dataset=data,
    ...                   callbacks=[GradzipCallback("powersgd:rank=4")])
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

try:
    from transformers import (
        Trainer,
        TrainerCallback,
        TrainerControl,
        TrainerState,
        TrainingArguments,
    )
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as _error:  # pragma: no cover - exercised without transformers installed
    from gradzip.integrations._common import missing_framework

    raise missing_framework("gradzip.integrations.transformers", "transformers", _error) from _error

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import gradzip.ddp
from gradzip.compressors.base import Compressor
from gradzip.integrations._common import ENGINE_OPTIONS, split_engine_options, with_optimizer
from gradzip.spec import compressor_from_spec

__all__ = ["GradzipCallback", "state_file"]

log = logging.getLogger(__name__)


def state_file(checkpoint_dir: str | os.PathLike[str], rank: int) -> str:
    """The file of ``rank``'s hook state in a Trainer checkpoint folder (one per rank, like the
    Trainer's own ``rng_state_<rank>.pth``)."""
    return os.path.join(os.fspath(checkpoint_dir), f"gradzip_state_rank{rank}.pt")


def _calling_trainer() -> tuple[Trainer, str | None]:
    """The Trainer whose training loop is calling a callback event, and the checkpoint it
    resumes from.

    Callback events receive the unwrapped model, never the Trainer or its DDP model
    (``trainer.model_wrapped``), so the callback finds the Trainer on the call stack: the
    training loop is a method of the Trainer, and ``resume_from_checkpoint`` is one of its
    arguments.
    """
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            resume = frame.f_locals.get("resume_from_checkpoint")
            return owner, resume if isinstance(resume, (str, os.PathLike)) else None
        frame = frame.f_back
    raise RuntimeError("GradzipCallback must be called by a transformers.Trainer's training loop")


class GradzipCallback(TrainerCallback):
    """Register gradzip's DDP communication hook on the Trainer's DDP model.

    On ``on_train_begin`` (after the Trainer wrapped the model in DDP, built the optimizer and
    restored a checkpoint's optimizer) the hook is registered, and when the Trainer resumes
    from a checkpoint each rank loads its own hook state from that folder
    (:func:`state_file`). On ``on_save`` each rank writes its state into the checkpoint folder
    just saved (``args.output_dir/checkpoint-<step>``; not with ``save_only_model``). Every
    rank needs to see that folder, as the Trainer's own per-rank RNG files do.

    Args:
        compressor: a :class:`~gradzip.Compressor` or spec string such as ``"topk:ratio=0.01"``.
        **engine_options: the fields of :class:`~gradzip.EngineOptions` (``error_feedback``,
            ``nonfinite``, ``dense_1d``, ``rules``, ``min_numel``, ...), an ``options`` record,
            ``overlap``, ``fuse_buckets``; ``optimizer`` defaults to the Trainer's.

    Attributes:
        state: the :class:`~gradzip.ddp.GradzipHookState` once training began (``stats``).

    Raises:
        TypeError, ValueError: an invalid compressor or an unknown option.
    """

    def __init__(self, compressor: Compressor | str, **engine_options: Any) -> None:
        unknown = sorted(set(engine_options) - ENGINE_OPTIONS)
        if unknown:
            raise TypeError(
                f"`engine_options` must be among {sorted(ENGINE_OPTIONS)}, got {unknown}"
            )
        split_engine_options(engine_options, "GradzipCallback")  # validates the values
        self.compressor = compressor_from_spec(compressor)
        self.engine_options = engine_options
        self.state: gradzip.ddp.GradzipHookState | None = None
        self._ddp_model: DistributedDataParallel | None = None

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        trainer, resume = _calling_trainer()
        model = trainer.model_wrapped
        if not isinstance(model, DistributedDataParallel):
            raise RuntimeError(
                "GradzipCallback needs the Trainer to train a DistributedDataParallel model "
                f"(2 or more processes, e.g. torchrun), got {type(model).__name__}"
            )
        if model is not self._ddp_model:  # a second train() on the same Trainer keeps its hook
            options = with_optimizer(self.engine_options, kwargs.get("optimizer"))
            self.state = gradzip.ddp.register(model, self.compressor, **options)
            self._ddp_model = model
        if resume is None and state.global_step > 0:
            resume = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if resume is not None:
            self._load(resume)

    def _load(self, checkpoint_dir: str | os.PathLike[str]) -> None:
        assert self.state is not None
        path = state_file(checkpoint_dir, dist.get_rank())
        if not os.path.isfile(path):
            log.warning("%s holds no gradzip state: compression state starts fresh", checkpoint_dir)
            return
        self.state.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # Every rank runs on_save right after the Trainer saved the checkpoint folder.
        if self.state is None or args.save_only_model:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        torch.save(self.state.state_dict(), state_file(folder, dist.get_rank()))
