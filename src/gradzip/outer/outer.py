"""The outer loop: H local steps, then the compressed average of the parameters' change."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from gradzip._validate import check_int, check_real
from gradzip.comm import Collective, default_collective
from gradzip.comm.header import verify_configuration
from gradzip.compressors.base import Compressor
from gradzip.engine import Engine
from gradzip.ops.flat import flatten_workers, unpack
from gradzip.outer.consensus import agree_on_parameters
from gradzip.outer.fragments import FragmentPlan, split_fragments
from gradzip.outer.group import exchange_collective
from gradzip.outer.optim import OuterOptimizer
from gradzip.outer.setup import check_models, check_optimizers, schedule_in_syncs
from gradzip.outer.setup import engine_options as engine_options_of
from gradzip.outer.state import FORMAT_VERSION, load_state, save_state

__all__ = ["FORMAT_VERSION", "Outer"]

log = logging.getLogger(__name__)

# OuterOptimizer's fields -> this constructor's parameters (for error messages).
_PARAM_NAMES = {"kind": "outer_optimizer", "lr": "outer_lr", "momentum": "outer_momentum",
                "decay": "error_decay"}


class Outer:
    """Outer-step training (the DiLoCo family) around the user's inner loop.

    Every worker runs its own inner optimizer; the user calls :meth:`step` after every inner
    optimizer step. Every ``inner_steps`` steps (per fragment), the *pseudo-gradient*
    ``anchor - params`` (``anchor``: the parameters at the last synchronisation, identical on
    every worker) is compressed with error feedback and averaged through an
    :class:`~gradzip.Engine`, the outer optimizer moves the anchor with it, and every worker's
    parameters are set to the new anchor (mixed with the local parameters by ``alpha``), so
    every worker holds identical parameters.

    Args:
        models: in a real process group (one worker per process), this worker's module; in a
            :class:`~gradzip.SimulatedGroup` of ``N`` workers, a sequence of ``N`` modules.
            Every worker must start from the same parameters (the simulated models are
            checked; in a process group seed them alike).
        compressor: any compressor spec, :class:`~gradzip.Compressor` or controller. A
            :class:`~gradzip.Schedule`'s ranges count inner steps, as in per-step training:
            a range holds the synchronisations sent after one of its steps (refused when it
            holds none).
        inner_steps: ``H``, inner steps between two synchronisations of a fragment, >= 1.
        outer_optimizer: ``"nesterov"`` (default; lr and momentum from ``H`` by
            :func:`~gradzip.outer_defaults`), ``"sgd"`` (lr 1.0, no momentum),
            ``"ef-momentum"`` (lr 1.0, residual decay 0.95, no momentum, error feedback on:
            refused with ``error_feedback=False``), or an :class:`OuterOptimizer` (its values
            as they are).
        outer_lr: replaces the outer optimizer's ``lr`` (given, it is used as given).
        outer_momentum: replaces the outer optimizer's ``momentum`` (likewise).
        error_decay: replaces the outer optimizer's residual ``decay``.
        fragments: ``P`` (streaming), >= 1, dividing ``H``, at most the number of tensors.
        delay: ``tau``, inner steps between sending a fragment and applying its result
            (streaming overlap), in ``[0, H / P)``.
        alpha: mixing factor in [0, 1]: a worker's tensor becomes
            ``anchor + alpha * (local - anchor)`` (0: the anchor).
        collective: a :class:`~gradzip.SimulatedGroup` or a process group collective
            (default: the world group). In a process group every rank constructs its
            ``Outer`` at the same point: the ranks' configurations are compared there.
        offload: keep the anchor and the outer optimizer's state on the CPU.
        overlap: with ``delay > 0``, run each exchange on a background thread while the next
            ``delay`` inner steps run (the results are the same bits as without it; an error
            of the exchange, e.g. ``nonfinite="raise"``, surfaces at the step that applies it).
            In a process group the exchange talks on its own copy of the group, so the inner
            loop may issue collectives of its own (a loss all-reduce, a barrier).
        inner_optimizers: the inner optimizers (one per model), optional: their state is
            then part of :meth:`state_dict`, and a skipped synchronisation clears it (see
            :meth:`step`).
        max_skipped_syncs: ``K`` >= 1 (default 3): after ``K`` skipped synchronisations in a
            row, :meth:`step` raises ``FloatingPointError`` on every worker.
        **engine_options: options of the :class:`~gradzip.Engine`: ``options`` (an
            :class:`~gradzip.EngineOptions`), its fields as keywords (they replace the
            record's), and ``decide_on``; never the gradient-only ``optimizer`` and
            ``grad_scaler``.

    Raises:
        TypeError, ValueError: invalid arguments, naming the parameter.

    Example:
        >>> outer = Outer(model, "topk:ratio=0.01", inner_steps=100)
        >>> for batch in data:
        ...     loss(model, batch).backward(); inner.step(); inner.zero_grad()
        ...     outer.step()
    """

    def __init__(
        self,
        models: nn.Module | Sequence[nn.Module],
        compressor: Compressor | str = "none",
        *,
        inner_steps: int,
        outer_optimizer: OuterOptimizer | str = "nesterov",
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        error_decay: float | None = None,
        fragments: int = 1,
        delay: int = 0,
        alpha: float = 0.0,
        collective: Collective | None = None,
        offload: bool = False,
        overlap: bool = False,
        inner_optimizers: Sequence[torch.optim.Optimizer] | None = None,
        max_skipped_syncs: int = 3,
        **engine_options: Any,
    ) -> None:
        self.plan = FragmentPlan(inner_steps, fragments, delay)
        try:
            # A kind given by name takes the lr and momentum not given from the H rule.
            self.optimizer = OuterOptimizer.build(
                outer_optimizer, inner_steps=self.plan.inner_steps, lr=outer_lr,
                momentum=outer_momentum, decay=error_decay)
        except (TypeError, ValueError) as err:
            # Name the parameters as this constructor calls them, not as the record does.
            text = str(err)
            for field, param in _PARAM_NAMES.items():
                text = text.replace(f"`{field}`", f"`{param}`")
            raise type(err)(text) from None
        self.alpha = check_real("alpha", alpha, low=0, high=1)
        for flag, value in (("offload", offload), ("overlap", overlap)):
            if not isinstance(value, bool):
                raise TypeError(f"`{flag}` must be a bool, got {type(value).__name__}")
        self.max_skipped_syncs = check_int("max_skipped_syncs", max_skipped_syncs, minimum=1)
        self.overlap = overlap and self.plan.delay > 0
        options, decide_on = engine_options_of(self.optimizer.kind, engine_options)
        if collective is not None and not isinstance(collective, Collective):
            raise TypeError(f"`collective` must be a gradzip Collective, got {type(collective).__name__}")
        self.comm = collective if collective is not None else default_collective()
        self.models = check_models(models, self.comm.local_workers)
        self.params = self._parameters()
        self.names = list(self.params)
        self.fragments = self._split_fragments()
        self.inner_optimizers = check_optimizers(inner_optimizers, len(self.models))
        self.offload = offload
        first = {n: ps[0] for n, ps in self.params.items()}
        self.device = next(iter(first.values())).device
        home = torch.device("cpu") if offload else self.device
        self.anchor: dict[str, torch.Tensor] = {n: p.detach().to(home, copy=True) for n, p in first.items()}
        self.outer_state: dict[str, torch.Tensor] = {}
        built = schedule_in_syncs(compressor, self.plan)
        self.handshake_bytes = 0
        if not (self.comm.simulated or self.comm.world_size == 1):
            # Checked here, before anything else is exchanged: ranks that differ in
            # ``overlap`` would otherwise disagree on whether the next collective is the copy
            # of the group below, and hang there.
            self.handshake_bytes += verify_configuration(
                self.comm, {**self.checkpoint_config(), "overlap": str(self.overlap),
                            "max_skipped_syncs": str(self.max_skipped_syncs),
                            "decide_on": decide_on})
        # With ``overlap`` the exchange runs on a background thread, on its own copy of the
        # process group (see gradzip.outer.group): never on the group the user's loop uses.
        exchange = exchange_collective(self.comm) if self.overlap else self.comm
        self.engine = Engine({n: p.shape for n, p in first.items()}, built,
                             collective=exchange, options=options, decide_on=decide_on)
        self.inner_step = 0
        self.syncs = 0
        self.skipped_syncs = 0
        #: Wire bytes per worker of :meth:`consensus` calls (not training's; not checkpointed).
        self.consensus_wire_bytes = 0
        #: Skipped synchronisations since the last applied one (see :meth:`step`).
        self.consecutive_skips = 0
        # The exchange in flight: (fragment, inner step at which to apply, averages or None
        # when the engine's non-finite policy handled the exchange).
        self.pending: tuple[int, int, dict[str, torch.Tensor] | None] | None = None
        # With ``overlap``: the exchange running on the background thread (its result becomes
        # ``pending``'s averages when settled), and the one-thread pool that runs it.
        self._in_flight: Future[dict[str, torch.Tensor] | None] | None = None
        self._pool: ThreadPoolExecutor | None = None

    # -- construction checks -----------------------------------------------------------------
    def _parameters(self) -> dict[str, list[torch.Tensor]]:
        """``name -> [each local worker's parameter]``; every worker's model must have the
        same trainable tensors and, in a simulated group, the same values."""
        per_model = [{n: p for n, p in m.named_parameters() if p.requires_grad} for m in self.models]
        first = per_model[0]
        if not first:
            raise ValueError("`models` must have trainable parameters, got none")
        for w, params in enumerate(per_model[1:], start=1):
            shapes = {n: p.shape for n, p in params.items()}
            if shapes != {n: p.shape for n, p in first.items()}:
                raise ValueError(f"`models` must all have the same parameters, got a different set in model {w}")
            for n, p in params.items():
                if not torch.equal(p.detach(), first[n].detach()):
                    raise ValueError(f"`models` must start from identical parameters, got `{n}` "
                                     f"differing between model 0 and model {w}")
        return {n: [params[n] for params in per_model] for n in first}

    def _split_fragments(self) -> list[tuple[str, ...]]:
        """The tensors of each fragment (a sharded model restricts them to its shards)."""
        return split_fragments(self.names, self.plan.fragments)

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> bool:
        """Count one inner step; synchronise when the schedule says so.

        Call it after every inner optimizer step, on every worker.

        A synchronisation whose pseudo-gradient is non-finite on some worker (NaN or Inf,
        with the engine's default ``nonfinite="skip"`` or ``"zero"``) is skipped: the anchor
        and the outer state stay, every worker's parameters return to the anchor (all
        fragments' tensors, exactly), and every inner optimizer given as
        ``inner_optimizers`` has its state cleared (as freshly built), on every worker alike,
        so training goes on from the last synchronised point. ``stats["skipped_syncs"]``
        counts them.

        Returns:
            Whether an exchange's result was applied to the parameters at this step.

        Raises:
            FloatingPointError: a non-finite pseudo-gradient with ``nonfinite="raise"`` (on
                every worker); nothing changed, the step was not counted. Or
                ``max_skipped_syncs`` synchronisations in a row were skipped (on every
                worker; the step was counted, every worker holds the anchor).
            RuntimeError, ValueError: workers out of step or configured differently.
        """
        step = self.inner_step + 1
        applied = False
        if self.pending is not None and self.pending[1] == step:
            self._settle()
            self._apply(*self.pending)
            self.pending = None
            applied = True
        fragment = self.plan.sent_after(step)
        if fragment is not None:
            deltas = self._deltas(fragment)
            if self.overlap:
                # The pseudo-gradient is taken now; only the exchange runs beside the next
                # inner steps. Nothing else touches the engine until it is settled, and the
                # inner loop issues no collectives, so on a process group the background
                # thread's collectives keep the same order on every rank.
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradzip-outer")
                self._in_flight = self._pool.submit(self._reduce, deltas)
                self.pending = (fragment, step + self.plan.delay, None)
            else:
                self.pending = (fragment, step + self.plan.delay, self._reduce(deltas))
            if self.plan.delay == 0:
                self._apply(*self.pending)
                self.pending = None
                applied = True
        self.inner_step = step
        if self.consecutive_skips >= self.max_skipped_syncs:
            # Decided from the engine's aggregated non-finite decision: every worker raises
            # here alike, at the same step.
            raise FloatingPointError(
                f"{self.consecutive_skips} synchronisations in a row were skipped (a NaN or "
                f"Inf pseudo-gradient on some worker each time; `max_skipped_syncs` is "
                f"{self.max_skipped_syncs}): the workers cannot train together; every worker "
                f"holds the last synchronised parameters")
        return applied

    def _stacked(self, name: str) -> torch.Tensor:
        """Every local worker's current tensor: ``[L, *shape]`` in a simulated group, the
        plain tensor in a process group (what the engine takes)."""
        params = self.params[name]
        if self.comm.simulated:
            return torch.stack([p.detach() for p in params])
        return params[0].detach()

    def _settle(self) -> None:
        """Wait for the exchange on the background thread, if any, and record its result."""
        if self._in_flight is None:
            return
        future, self._in_flight = self._in_flight, None
        assert self.pending is not None
        fragment, due, _ = self.pending
        try:
            self.pending = (fragment, due, future.result())
        except BaseException:
            self.pending = None
            raise

    def _deltas(self, fragment: int) -> dict[str, torch.Tensor]:
        """One fragment's pseudo-gradient, what the engine is handed."""
        decay = float(self.optimizer.decay)  # type: ignore[arg-type]
        deltas = {}
        for name in self.fragments[fragment]:
            delta = self.anchor[name].to(self.device) - self._stacked(name)
            residual = self.engine.residuals.get(name) if decay != 1.0 else None
            if residual is not None:
                # The engine adds its residual r to what it is given: handing it
                # delta - (1 - decay) * r makes it compress delta + decay * r, the decayed
                # error feedback that stands in for outer momentum.
                delta = delta - (1.0 - decay) * (residual if self.comm.simulated else residual[0])
            deltas[name] = delta
        return deltas

    def _reduce(self, deltas: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Exchange a pseudo-gradient; its averages, or ``None`` when the engine's non-finite
        policy handled it (a non-finite pseudo-gradient on some worker)."""
        skipped = self.engine.stats["skipped_steps"]
        averaged = self.engine.reduce(deltas, step=self.syncs)
        self.syncs += 1
        if self.engine.stats["skipped_steps"] != skipped:
            self.skipped_syncs += 1
            return None
        return averaged

    @torch.no_grad()
    def _apply(self, fragment: int, _due: int, averaged: dict[str, torch.Tensor] | None) -> None:
        """The outer step on one fragment, then every worker's tensors from the new anchor.
        Without averages (a handled non-finite exchange) see :meth:`_recover`."""
        if averaged is None:
            self.consecutive_skips += 1
            self._recover()
            return
        self.consecutive_skips = 0
        for name in self.fragments[fragment]:
            self.anchor[name] = self.optimizer.apply(
                name, self.anchor[name], averaged[name], self.outer_state)
            synced = self.anchor[name].to(self.device)
            for param in self.params[name]:
                if self.alpha == 0.0:
                    param.copy_(synced)
                else:
                    param.copy_(synced.lerp(param, self.alpha))

    @torch.no_grad()
    def _recover(self) -> None:
        """After a skipped synchronisation: every worker back to the anchor, whole, and its
        inner optimizer's state cleared.

        Some worker's parameters turned non-finite, and with them, possibly, its inner
        optimizer's state (momentum, Adam's moments) and, through the next forward pass, the
        tensors of every other fragment. Returning only the skipped fragment would leave that
        poison in place and every later synchronisation would be skipped too. So every
        tensor of every fragment returns to its anchor (exactly: ``alpha`` does not mix in a
        non-finite local value), and every inner optimizer starts afresh, on every worker
        alike (the decision is the engine's, aggregated over workers), so the workers stay
        identical and the simulator and process groups give the same bits. Progress since
        each fragment's last synchronisation is lost.
        """
        for name in self.names:
            synced = self.anchor[name].to(self.device)
            for param in self.params[name]:
                param.copy_(synced)
        if not self.inner_optimizers:
            log.warning("a synchronisation was skipped (a non-finite pseudo-gradient) and the "
                        "outer loop holds no inner optimizers to reset: pass "
                        "`inner_optimizers` so that a poisoned optimizer state is cleared")
        for opt in self.inner_optimizers:
            opt.state.clear()

    @torch.no_grad()
    def consensus(self) -> dict[str, torch.Tensor]:
        """The workers' mean of every trained tensor now: the model they agree on.

        Between two synchronisations each worker trains its own replica, so any one worker's
        parameters are one worker's model, not the run's. Evaluate, export or keep this
        instead, above all when training stops between synchronisations. Nothing changes:
        not the parameters, the anchor, the outer state or the counters, so training goes on
        (or resumes from a checkpoint) exactly as without the call.

        Each worker sends a 24-byte digest of its parameters; the dense fp32 parameters are
        averaged only where two digests differ (right after a synchronisation without
        ``delay`` or ``alpha``, every worker holds the anchor and nothing more is sent). The
        bytes are counted apart from training's, in ``stats["consensus_wire_bytes"]``. In a
        process group this is a collective: every rank calls it at the same point.

        Returns:
            ``name -> tensor`` of the parameter's shape, dtype and device (fresh tensors;
            for a simulated group, one tensor for every worker).
        """
        self._settle()
        rows = flatten_workers([self._stacked(n).to(torch.float32) for n in self.names],
                               len(self.models))
        # Evaluation traffic, not training's: counted on its own, and the collective's meter
        # (the engine's byte counters when the exchange runs on it) left as it was.
        before = list(self.comm.meter.wire)
        snapshot = self.comm.meter.snapshot()
        mean = agree_on_parameters(rows, self.comm)
        self.consensus_wire_bytes += max(w - b for w, b in zip(self.comm.meter.wire, before,
                                                                strict=True))
        self.comm.meter.load(snapshot)
        mine = [self.params[n][0] for n in self.names]
        if mean is None:
            return {n: p.detach().clone() for n, p in zip(self.names, mine, strict=True)}
        parts = unpack(mean, [p.shape for p in mine])
        return {n: part.to(device=p.device, dtype=p.dtype)
                for n, p, part in zip(self.names, mine, parts, strict=True)}

    # -- agreement, observability, checkpoints -------------------------------------------------
    def checkpoint_config(self) -> dict[str, str]:
        """The configuration a checkpoint records and a load must match (also part of what
        ranks compare before the first exchange)."""
        plan = self.plan
        return {
            "outer_optimizer": self.optimizer.describe(),
            "schedule": f"H={plan.inner_steps},P={plan.fragments},delay={plan.delay},alpha={self.alpha}",
            "fragments": ";".join(",".join(f) for f in self.fragments),
        }

    @property
    def stats(self) -> dict[str, Any]:
        """The engine's byte counters (:attr:`Engine.stats`; one engine step per exchange)
        plus ``inner_steps``, ``syncs``, ``skipped_syncs``, ``outer_handshake_bytes`` and
        ``consensus_wire_bytes`` (waits for an exchange in flight)."""
        self._settle()
        return {**self.engine.stats, "inner_steps": self.inner_step, "syncs": self.syncs,
                "skipped_syncs": self.skipped_syncs, "outer_handshake_bytes": self.handshake_bytes,
                "consensus_wire_bytes": self.consensus_wire_bytes}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: the anchor, the outer optimizer's state, the
        engine's state (residuals: per rank, so one file per rank), the exchange in flight, the
        counters, and the inner optimizers' state where they were given. The models'
        parameters are the user's to save. Waits for an exchange in flight."""
        self._settle()
        return save_state(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output: all of it or nothing.

        Every part is checked before anything changes, with the engine's checks for its
        own (:meth:`Engine.load_state_dict`): names, shapes, dtypes, counters consistent with
        the schedule, the exchange in flight, the inner optimizers' states, and finite values
        everywhere. When this raises, the outer loop, its engine and the inner optimizers
        are as they were.

        Raises:
            TypeError: ``state`` is not a mapping.
            ValueError: another format, configuration or parameter set, inconsistent
                counters, or non-finite values (the first problem is named).
        """
        self._settle()
        load_state(self, state)
