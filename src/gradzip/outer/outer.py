"""The outer loop: H local steps, then the compressed average of the parameters' change."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from gradzip._validate import check_real
from gradzip.comm import Collective, default_collective
from gradzip.comm.header import verify_configuration
from gradzip.compressors.base import Compressor
from gradzip.engine import Engine
from gradzip.outer.fragments import FragmentPlan, split_fragments
from gradzip.outer.optim import OuterOptimizer

__all__ = ["FORMAT_VERSION", "Outer"]

FORMAT_VERSION = 1

# OuterOptimizer's fields -> this constructor's parameters (for error messages).
_PARAM_NAMES = {"kind": "outer_optimizer", "lr": "outer_lr", "momentum": "outer_momentum",
                "decay": "error_decay"}

# Engine options that concern gradients of a loss, not pseudo-gradients.
_GRADIENT_ONLY = ("optimizer", "grad_scaler")


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
        compressor: any compressor spec, :class:`~gradzip.Compressor` or controller.
        inner_steps: ``H``, inner steps between two synchronisations of a fragment, >= 1.
        outer_optimizer: ``"nesterov"`` (default: lr 0.7, momentum 0.9), ``"sgd"`` (lr 1.0,
            no momentum), ``"ef-momentum"`` (lr 1.0, residual decay 0.95, no momentum), or an
            :class:`OuterOptimizer`.
        outer_lr: replaces the outer optimizer's ``lr``.
        outer_momentum: replaces the outer optimizer's ``momentum``.
        error_decay: replaces the outer optimizer's residual ``decay``.
        fragments: ``P`` (streaming), >= 1, dividing ``H``, at most the number of tensors.
        delay: ``tau``, inner steps between sending a fragment and applying its result
            (streaming overlap), in ``[0, H / P)``.
        alpha: mixing factor in [0, 1]: a worker's tensor becomes
            ``anchor + alpha * (local - anchor)`` (0: the anchor).
        collective: a :class:`~gradzip.SimulatedGroup` or a process group collective
            (default: the world group).
        offload: keep the anchor and the outer optimizer's state on the CPU.
        overlap: with ``delay > 0``, run each exchange on a background thread while the next
            ``delay`` inner steps run (the results are the same bits as without it; an error
            of the exchange, e.g. ``nonfinite="raise"``, surfaces at the step that applies it).
        inner_optimizers: the inner optimizers (one per model), optional: their state is
            then part of :meth:`state_dict`.
        **engine_options: options of the :class:`~gradzip.Engine` (``error_feedback``,
            ``nonfinite``, ``rules``, ...), except the gradient-only ``optimizer`` and
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
        **engine_options: Any,
    ) -> None:
        self.plan = FragmentPlan(inner_steps, fragments, delay)
        try:
            self.optimizer = OuterOptimizer.build(
                outer_optimizer, lr=outer_lr, momentum=outer_momentum, decay=error_decay)
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
        self.overlap = overlap and self.plan.delay > 0
        for key in _GRADIENT_ONLY:
            if key in engine_options:
                raise ValueError(f"`{key}` applies to gradients, not pseudo-gradients: the outer "
                                 f"loop does not take it, got {key}={engine_options[key]!r}")
        if self.optimizer.kind == "ef-momentum":
            if engine_options.get("error_feedback") is False:
                raise ValueError("`error_feedback` must be on for the ef-momentum outer optimizer "
                                 "(its residual is the momentum), got False")
            engine_options["error_feedback"] = True
        if collective is not None and not isinstance(collective, Collective):
            raise TypeError(f"`collective` must be a gradzip Collective, got {type(collective).__name__}")
        self.comm = collective if collective is not None else default_collective()
        self.models = self._check_models(models)
        self.params = self._parameters()
        self.names = list(self.params)
        self.fragments = split_fragments(self.names, self.plan.fragments)
        self.inner_optimizers = self._check_optimizers(inner_optimizers)
        self.offload = offload
        first = {n: ps[0] for n, ps in self.params.items()}
        self.device = next(iter(first.values())).device
        home = torch.device("cpu") if offload else self.device
        self.anchor: dict[str, torch.Tensor] = {n: p.detach().to(home, copy=True) for n, p in first.items()}
        self.outer_state: dict[str, torch.Tensor] = {}
        self.engine = Engine({n: p.shape for n, p in first.items()}, compressor,
                             collective=self.comm, **engine_options)
        self.inner_step = 0
        self.syncs = 0
        self.skipped_syncs = 0
        # The exchange in flight: (fragment, inner step at which to apply, averages or None
        # when the engine's non-finite policy handled the exchange).
        self.pending: tuple[int, int, dict[str, torch.Tensor] | None] | None = None
        # With ``overlap``: the exchange running on the background thread (its result becomes
        # ``pending``'s averages when settled), and the one-thread pool that runs it.
        self._in_flight: Future[dict[str, torch.Tensor] | None] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._verified = self.comm.simulated or self.comm.world_size == 1
        self.handshake_bytes = 0

    # -- construction checks -----------------------------------------------------------------
    def _check_models(self, models: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
        workers = self.comm.local_workers
        listed = [models] if isinstance(models, nn.Module) else models
        if not isinstance(listed, Sequence) or not all(isinstance(m, nn.Module) for m in listed):
            raise TypeError(f"`models` must be a module or a sequence of modules, got {type(models).__name__}")
        if len(listed) != workers:
            raise ValueError(f"`models` must hold one module per local worker ({workers}), got {len(listed)}")
        return list(listed)

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

    def _check_optimizers(
        self, optimizers: Sequence[torch.optim.Optimizer] | None
    ) -> list[torch.optim.Optimizer]:
        if optimizers is None:
            return []
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = [optimizers]
        if len(optimizers) != len(self.models) or not all(
            isinstance(o, torch.optim.Optimizer) for o in optimizers
        ):
            raise ValueError(f"`inner_optimizers` must hold one optimizer per model ({len(self.models)}), "
                             f"got {len(optimizers)}")
        return list(optimizers)

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> bool:
        """Count one inner step; synchronise when the schedule says so.

        Call it after every inner optimizer step, on every worker.

        Returns:
            Whether an exchange's result was applied to the parameters at this step.

        Raises:
            FloatingPointError: a non-finite pseudo-gradient with ``nonfinite="raise"`` (on
                every worker); nothing changed, the step was not counted.
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
        if not self._verified:
            self.handshake_bytes += verify_configuration(self.comm, self._fingerprint())
            self._verified = True
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
        Without averages (a handled non-finite exchange) the anchor stays and workers return
        to it."""
        for name in self.fragments[fragment]:
            if averaged is not None:
                self.anchor[name] = self.optimizer.apply(
                    name, self.anchor[name], averaged[name], self.outer_state)
            synced = self.anchor[name].to(self.device)
            for param in self.params[name]:
                if self.alpha == 0.0:
                    param.copy_(synced)
                else:
                    param.copy_(synced.lerp(param, self.alpha))

    # -- agreement, observability, checkpoints -------------------------------------------------
    def _fingerprint(self) -> dict[str, str]:
        plan = self.plan
        return {
            "outer_optimizer": self.optimizer.describe(),
            "schedule": f"H={plan.inner_steps},P={plan.fragments},delay={plan.delay},alpha={self.alpha}",
            "fragments": ";".join(",".join(f) for f in self.fragments),
        }

    @property
    def stats(self) -> dict[str, Any]:
        """The engine's byte counters (:attr:`Engine.stats`; one engine step per exchange)
        plus ``inner_steps``, ``syncs``, ``skipped_syncs`` and ``outer_handshake_bytes``
        (waits for an exchange in flight)."""
        self._settle()
        return {**self.engine.stats, "inner_steps": self.inner_step, "syncs": self.syncs,
                "skipped_syncs": self.skipped_syncs, "outer_handshake_bytes": self.handshake_bytes}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: the anchor, the outer optimizer's state, the
        engine's state (residuals: per rank, so one file per rank), the exchange in flight, and
        the inner optimizers' state where they were given. The models' parameters are the
        user's to save. Waits for an exchange in flight."""
        self._settle()
        pending = None
        if self.pending is not None:
            fragment, due, averaged = self.pending
            pending = {"fragment": fragment, "due": due,
                       "averaged": None if averaged is None else {n: t.clone() for n, t in averaged.items()}}
        return {
            "format_version": FORMAT_VERSION,
            "config": self._fingerprint(),
            "inner_step": self.inner_step,
            "syncs": self.syncs,
            "skipped_syncs": self.skipped_syncs,
            "anchor": {n: t.clone() for n, t in self.anchor.items()},
            "outer_state": {n: t.clone() for n, t in self.outer_state.items()},
            "pending": pending,
            "engine": self.engine.state_dict(),
            "inner_optimizers": [o.state_dict() for o in self.inner_optimizers],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (checked whole before anything changes).

        Raises:
            ValueError: another format, configuration or parameter set, or non-finite values.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"`state` must be a mapping, got {type(state).__name__}")
        if state.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"`state` must have format_version {FORMAT_VERSION}, got {state.get('format_version')!r}")
        if dict(state["config"]) != self._fingerprint():
            raise ValueError(f"`state` must come from the same outer configuration, got {dict(state['config'])}")
        anchor = dict(state["anchor"])
        if set(anchor) != set(self.names) or any(anchor[n].shape != self.anchor[n].shape for n in self.names):
            raise ValueError("`state` must hold the anchor of the same parameters (names and shapes)")
        tensors = [*anchor.values(), *dict(state["outer_state"]).values()]
        if any(not bool(torch.isfinite(t).all()) for t in tensors):
            raise ValueError("`state` must hold finite anchor and outer state, got NaN or Inf")
        optimizers = list(state["inner_optimizers"])
        if len(optimizers) != len(self.inner_optimizers):
            raise ValueError(f"`state` must hold {len(self.inner_optimizers)} inner optimizer states, "
                             f"got {len(optimizers)}")
        self._settle()
        self.engine.load_state_dict(state["engine"])
        for opt, opt_state in zip(self.inner_optimizers, optimizers, strict=True):
            opt.load_state_dict(opt_state)
        home = torch.device("cpu") if self.offload else self.device
        self.anchor = {n: anchor[n].to(home, copy=True) for n in self.names}
        self.outer_state = OuterOptimizer.state_to(state["outer_state"], home)
        self.inner_step, self.syncs = int(state["inner_step"]), int(state["syncs"])
        self.skipped_syncs = int(state["skipped_syncs"])
        pending = state["pending"]
        self.pending = None if pending is None else (
            int(pending["fragment"]), int(pending["due"]),
            None if pending["averaged"] is None else {n: t.clone() for n, t in pending["averaged"].items()})
