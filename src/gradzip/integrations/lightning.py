"""gradzip for PyTorch Lightning: a ``DDPStrategy`` for the Trainer, another for Fabric.

Lightning's own route, ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)``, registers a
comm hook only when the device is CUDA (on CPU the hook is silently ignored), saves no hook
state in checkpoints, and Fabric's ``DDPStrategy`` takes no hook at all. These strategies
register gradzip's hook on the ``DistributedDataParallel`` model they build, on every device.

Examples:
    >>> from gradzip.integrations.lightning import GradzipDDPStrategy
    >>> trainer = L.Trainer(strategy=GradzipDDPStrategy("topk:ratio=0.01"), devices=2)

    >>> from gradzip.integrations.lightning import GradzipFabricDDPStrategy
    >>> fabric = L.Fabric(strategy=GradzipFabricDDPStrategy("powersgd:rank=2"), devices=2)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

try:
    import lightning.pytorch as pl
    from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as _error:  # pragma: no cover - exercised without lightning installed
    from gradzip.integrations._common import missing_framework

    raise missing_framework("gradzip.integrations.lightning", "lightning", _error) from _error

from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

import gradzip.ddp
from gradzip.compressors.base import Compressor
from gradzip.integrations._common import hook_metrics, split_engine_options, with_optimizer
from gradzip.spec import compressor_from_spec

__all__ = ["CHECKPOINT_KEY", "GradzipDDPStrategy", "GradzipFabricDDPStrategy"]

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "gradzip"
"""The checkpoint entry holding every rank's hook state."""


class GradzipDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` with gradzip as the DDP communication hook.

    The hook is registered when fitting starts, once the model is wrapped in DDP and the
    optimizers exist (on CPU and GPU). Checkpoints written by ``trainer.save_checkpoint`` or
    ``ModelCheckpoint`` hold every rank's hook state under ``"gradzip"`` (Lightning writes the
    file from rank 0, so the states are gathered first), and ``trainer.fit(ckpt_path=...)``
    gives each rank its own state back. Weights-only checkpoints hold none. Each ``fit`` wraps
    the model in a new DDP and so starts a new hook state, unless it resumes from a checkpoint.

    Every optimizer step (every ``trainer.log_every_n_steps``-th) logs rank 0's counters to
    the trainer's loggers: ``gradzip/wire_bytes``, ``gradzip/compression_rate``, ... and for an
    Accordion ``gradzip/level_share/<level>`` (see :func:`~gradzip.integrations._common.hook_metrics`).

    Args:
        compressor: a :class:`~gradzip.Compressor` or spec string such as ``"topk:ratio=0.01"``.
        log_stats: log the counters to the trainer's loggers.
        **options: the fields of :class:`~gradzip.EngineOptions` (``error_feedback``,
            ``nonfinite``, ``grad_scaler``, ``dense_1d``, ``rules``, ``min_numel``, ...;
            ``optimizer`` defaults to the trainer's first optimizer), an ``options`` record,
            ``overlap`` and ``fuse_buckets`` configure the hook; every other keyword goes to
            ``DDPStrategy`` (``find_unused_parameters``, ``bucket_cap_mb``, ``timeout``, ...).

    Attributes:
        hook_state: the :class:`~gradzip.ddp.GradzipHookState` of the current fit (``None``
            before one), with ``stats``.

    Raises:
        TypeError, ValueError: an invalid compressor, ``log_stats``, or a ``ddp_comm_*`` keyword.
    """

    def __init__(self, compressor: Compressor | str, *, log_stats: bool = True, **options: Any) -> None:
        engine_options, ddp_options = split_engine_options(options, "GradzipDDPStrategy")
        if not isinstance(log_stats, bool):
            raise TypeError(f"`log_stats` must be a bool, got {log_stats!r}")
        super().__init__(**ddp_options)
        self.compressor = compressor_from_spec(compressor)
        self.engine_options = engine_options
        self.log_stats = log_stats
        self.hook_state: gradzip.ddp.GradzipHookState | None = None
        self._restored: dict[str, Any] | None = None

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            self._restored = None
            return
        model = self.model
        # DDPStrategy.setup wraps the model before it builds the optimizers; registering here,
        # after both, lets the hook read the learning rate and still precede the first backward.
        assert isinstance(model, DistributedDataParallel), type(model)
        options = with_optimizer(self.engine_options, self.optimizers[0] if self.optimizers else None)
        self.hook_state = gradzip.ddp.register(model, self.compressor, **options)
        if self._restored is not None:
            restored, self._restored = self._restored, None
            self.hook_state.load_state_dict(restored)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # Lightning reads the checkpoint on every rank before `setup` builds the DDP model: keep
        # the gathered states until the hook exists.
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        restored = checkpoint.get(CHECKPOINT_KEY)
        if restored is None and "optimizer_states" in checkpoint:
            log.warning("%s holds no gradzip state: compression state starts fresh", checkpoint_path)
        self._restored = restored
        return checkpoint

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        # Every rank calls this (Trainer.save_checkpoint's contract), so gathering is safe; the
        # condition is the same on every rank (a weights-only checkpoint has no optimizer state).
        if self.hook_state is not None and "optimizer_states" in checkpoint:
            checkpoint = {**checkpoint, CHECKPOINT_KEY: self.hook_state.gathered().state_dict()}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.log_stats and self.hook_state is not None and self.is_global_zero:
            self._log(self.lightning_module.trainer)
        return output

    def _log(self, trainer: pl.Trainer) -> None:
        if not trainer.loggers or (trainer.global_step + 1) % trainer.log_every_n_steps:
            return
        metrics = hook_metrics(self.hook_state)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


class GradzipFabricDDPStrategy(FabricDDPStrategy):
    """Fabric's ``DDPStrategy`` with gradzip as the DDP communication hook.

    ``fabric.setup(model, optimizer)`` wraps the model in DDP and registers the hook (the
    optimizer, when set up together, is read for the learning rate). ``fabric.save`` adds every
    rank's hook state under ``"gradzip"`` (unless the state dict has that key already), and
    ``fabric.load`` gives each rank its own state back. One model per strategy: a second
    ``setup`` raises.

    Args:
        compressor: a :class:`~gradzip.Compressor` or spec string.
        **options: the keywords of :func:`gradzip.ddp.register` configure the hook; every
            other keyword goes to Fabric's ``DDPStrategy``.

    Attributes:
        hook_state: the :class:`~gradzip.ddp.GradzipHookState` once a model is set up.

    Raises:
        TypeError, ValueError: an invalid compressor or a ``ddp_comm_*`` keyword.
    """

    def __init__(self, compressor: Compressor | str, **options: Any) -> None:
        engine_options, ddp_options = split_engine_options(options, "GradzipFabricDDPStrategy")
        super().__init__(**ddp_options)
        self.compressor = compressor_from_spec(compressor)
        self.engine_options = engine_options
        self.hook_state: gradzip.ddp.GradzipHookState | None = None
        self._optimizer: Optimizer | None = None

    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[Module, list[Optimizer], Any]:
        self._optimizer = optimizers[0] if optimizers else None
        try:
            return super().setup_module_and_optimizers(module, optimizers, scheduler)
        finally:
            self._optimizer = None

    def setup_module(self, module: Module) -> DistributedDataParallel:
        ddp_model = super().setup_module(module)
        if self.hook_state is not None:
            raise RuntimeError("GradzipFabricDDPStrategy sets up one model; got a second one")
        options = with_optimizer(self.engine_options, self._optimizer)
        self.hook_state = gradzip.ddp.register(ddp_model, self.compressor, **options)
        return ddp_model

    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        # Fabric converts stateful objects on every rank (so the gather is safe) and writes
        # from rank 0.
        if self.hook_state is not None and CHECKPOINT_KEY not in state:
            state = {**state, CHECKPOINT_KEY: self.hook_state.gathered()}
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None,
    ) -> dict[str, Any]:
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        # The entries nobody asked for come back; take ours when the hook exists.
        if self.hook_state is not None and isinstance(remainder, dict) and CHECKPOINT_KEY in remainder:
            self.hook_state.load_state_dict(remainder.pop(CHECKPOINT_KEY))
        return remainder

