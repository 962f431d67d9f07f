"""What an engine holds: its configuration, its compression state, its counters.

:class:`EngineBase` is everything of :class:`~gradzip.Engine` but the step: the parameters and
their routes, every compressor's state and every residual, the byte and step counters, and the
small helpers every path uses (the state as one list, a snapshot of it, the step context, the
agreement handshake). The step itself (:mod:`gradzip.engine.core`) and its paths
(:mod:`gradzip.engine.host`, :mod:`~gradzip.engine.device`, :mod:`~gradzip.engine.flat`) are
functions over an engine and its :class:`~gradzip.engine.step.Step`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from gradzip._validate import check_choice, check_grad_dtype, named_params_and_shapes
from gradzip.comm.base import Collective
from gradzip.comm.header import verify_configuration
from gradzip.comm.torch_dist import default_collective
from gradzip.compressors.base import Compressor, Job, StepContext
from gradzip.compressors.none import NoCompression
from gradzip.engine.error import ErrorMeter
from gradzip.engine.routing import Router
from gradzip.engine.step import Saved, SkipCount, Step
from gradzip.ops.random import stable_hash
from gradzip.options import MAIN_ROUTE, EngineOptions
from gradzip.spec import compressor_from_spec

__all__ = ["DECIDE_ON", "STATS_KEYS", "EngineBase"]

#: The keys of :attr:`Engine.stats`.
STATS_KEYS = ("steps", "skipped_steps", "payload_bytes", "wire_bytes", "dense_payload_bytes",
              "dense_wire_bytes", "collective_calls", "handshake_bytes")

#: Where an engine may read its non-finite decisions (see :class:`~gradzip.Engine`).
DECIDE_ON = ("auto", "host", "device")


class EngineBase:
    """The configuration and state of :class:`~gradzip.Engine` (documented there)."""

    def __init__(
        self,
        params: nn.Module | Iterable[tuple[str, torch.Tensor]] | Mapping[str, Any],
        compressor: Compressor | str,
        *,
        collective: Collective | None = None,
        options: EngineOptions | None = None,
        decide_on: str = "auto",
        **engine_options: Any,
    ) -> None:
        self.params, shapes = named_params_and_shapes(params)
        self.compressor = compressor_from_spec(compressor)
        self.options = options = EngineOptions.build(options, **engine_options)
        self.error_feedback = options.feedback_for(self.compressor)
        self.nonfinite = options.nonfinite
        self.dense_1d = options.dense_1d
        if collective is not None and not isinstance(collective, Collective):
            raise TypeError(
                f"`collective` must be a gradzip Collective, got {type(collective).__name__}"
            )
        self.decide_on = decide_on
        self.optimizer = options.optimizer
        self.grad_scaler = options.grad_scaler
        self.residual_scale: float | None = None
        self.comm = collective if collective is not None else default_collective()
        self.shapes: dict[str, torch.Size] = {n: torch.Size(s) for n, s in shapes.items()}
        self._order = {n: i for i, n in enumerate(self.shapes)}
        self._router = Router(self.shapes, self.compressor, options)
        self.dense_names = self._router.dense_names
        #: Each rule's compressor (``None`` for a dense rule), in rule order.
        self.rule_compressors = self._router.rule_compressors
        self._feedback = self._router.feedback_names
        self.step = 0
        self._skips = SkipCount()
        self.dense_payload = [0] * self.comm.local_workers
        self.dense_wire = [0] * self.comm.local_workers
        self.residuals: dict[str, torch.Tensor] = {}
        self.compressor_state = self._router.fresh_state(MAIN_ROUTE, self.comm)
        #: Each rule's compressor state (``{}`` for a dense rule), in rule order.
        self.rule_states: list[Any] = self._router.fresh_rule_states(self.comm)
        #: The step in progress (every per-step flag lives there).
        self._step = Step()
        self._name_codes = {n: stable_hash("tensor", n, tuple(s)) for n, s in self.shapes.items()}
        self._verified = self.comm.simulated or self.comm.world_size == 1
        self.handshake_bytes = 0
        used = [self.compressor, *self.rule_compressors]
        self._errors = ErrorMeter(
            self._feedback, exact=all(c is None or isinstance(c, NoCompression) for c in used)
        )

    @property
    def decide_on(self) -> str:
        """Where calls read their non-finite decisions: ``"auto"``, ``"host"`` or
        ``"device"`` (see :class:`~gradzip.Engine`). Part of the ranks' configuration check
        before the first step; set it on every rank alike."""
        return self._decide_on

    @decide_on.setter
    def decide_on(self, value: str) -> None:
        self._decide_on = check_choice("decide_on", value, DECIDE_ON)

    # -- routing: which compressor reduces which tensor (see gradzip.engine.routing) -------
    def _compressed_shapes(self) -> dict[str, torch.Size]:
        return self._router.shapes_of(MAIN_ROUTE)

    def _reduce_routed(self, jobs: list[Job], comm: Collective) -> None:
        """Hand each compressor the jobs routed to it (a tensor's route is fixed at
        construction and agreed across ranks by the handshake), exchanging through ``comm``
        (the engine's collective, or one that carries the call header in the payload)."""
        if not self.rule_compressors:
            if jobs:
                self.compressor.reduce(jobs, self.compressor_state, comm, self._context())
            return
        self._router.reduce(jobs, self._states(), comm, self._context())

    def _begin_compressors_step(self) -> None:
        """Every compressor's beginning of step (see
        :meth:`~gradzip.compressors.base.Compressor.begin_step`), on the plain collective:
        before the step's first call, so no call header rides on what it sends."""
        self._router.begin_step(self._states(), self.comm, self._context())

    def _end_compressors_step(self) -> None:
        """Every compressor's end of step (also those that received no tensor this step)."""
        self._router.end_step(self._states(), self._context())

    # -- the compression state as one value (snapshots, rollback, finiteness tests) ---------
    def _states(self) -> list[Any]:
        return [self.compressor_state, *self.rule_states]

    def _set_states(self, states: list[Any]) -> None:
        self.compressor_state, self.rule_states = states[0], list(states[1:])

    @staticmethod
    def _state_tree(states: list[Any]) -> dict[str, Any]:
        tree = {"compressor_state": states[0]}
        if len(states) > 1:
            tree["rule_states"] = {str(i): s for i, s in enumerate(states[1:])}
        return tree

    def _save(self) -> Saved:
        """The compression state now (every compressor's state and every residual)."""
        return Saved.take(self._states(), self.residuals)

    def _restore(self, saved: Saved) -> None:
        """Put the compression state back to ``saved`` (which stays usable)."""
        fresh = saved.copy()
        self._set_states(fresh.states)
        self.residuals = fresh.residuals

    def _measure(self, jobs: list[Job]) -> None:
        """Add a call's jobs to the step's compression-error sums (after the compressor's
        ``reduce``, before its ``end_step``: a controller's levels are this call's)."""
        self._errors.add(
            self._step.error_sums, jobs,
            lambda: self.compressor.tensor_levels(self.compressor_state),
        )

    # -- context ---------------------------------------------------------------------------
    @property
    def simulated(self) -> bool:
        """Whether gradients carry a leading worker axis (a simulated group)."""
        return self.comm.simulated

    def _context(self) -> StepContext:
        lr = None
        if self.optimizer is not None and self.optimizer.param_groups:
            lr = float(self.optimizer.param_groups[0]["lr"])
        return StepContext(
            step=self.step, ranks=tuple(self.comm.local_ranks), world_size=self.comm.world_size,
            lr=lr,
        )

    def _as_worker_axis(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        if not isinstance(grad, torch.Tensor):
            raise TypeError(f"gradient `{name}` must be a tensor, got {type(grad).__name__}")
        check_grad_dtype(name, grad)
        if name not in self.shapes:
            raise ValueError(
                f"gradient names must be parameters of this engine, got unknown name {name!r}"
            )
        want = self.shapes[name]
        if self.simulated:
            expected = torch.Size((self.comm.local_workers, *want))
            if grad.shape != expected:
                raise ValueError(
                    f"gradient `{name}` must have shape {tuple(expected)} (workers first), "
                    f"got {tuple(grad.shape)}"
                )
            return grad
        if grad.shape != want:
            raise ValueError(f"gradient `{name}` must have shape {tuple(want)}, got {tuple(grad.shape)}")
        return grad.unsqueeze(0)

    # -- agreement across ranks -------------------------------------------------------------
    def _fingerprint(self) -> dict[str, str]:
        return {
            "compressor": self.compressor.spec(),
            "error_feedback": str(self.error_feedback),
            "nonfinite": self.nonfinite,
            "dense_1d": str(self.dense_1d),
            "parameters": ";".join(f"{n}:{tuple(s)}" for n, s in sorted(self.shapes.items())),
            "rules": "; ".join(self._rule_specs()),
            "min_numel": str(self.options.min_numel),
            # Ranks that read their non-finite decisions in different places send different
            # messages after a non-finite call (the host path only the header, the device
            # path its payload): they would abort or hang at the first NaN step.
            "decide_on": self.decide_on,
        }

    def _rule_specs(self) -> list[str]:
        return [rule.describe() for rule in self.options.rules]

    def _verify_agreement(self) -> None:
        """Check once, before the first step, that every rank runs the same configuration on
        the same parameters (counted in ``stats["handshake_bytes"]``)."""
        self.handshake_bytes += verify_configuration(self.comm, self._fingerprint())
        self._verified = True

    def _follow_loss_scale(self) -> None:
        """Bring residuals to the scaler's current loss scale (at the start of a step)."""
        if self.grad_scaler is None or not self.grad_scaler.is_enabled():
            return
        scale = float(self.grad_scaler.get_scale())
        if self.residual_scale is not None and scale != self.residual_scale:
            ratio = scale / self.residual_scale
            self.residuals = {n: r * ratio for n, r in self.residuals.items()}
        self.residual_scale = scale

    # -- observability ---------------------------------------------------------------------
    @property
    def skipped_steps(self) -> int:
        """Steps handled by the ``"skip"`` or ``"zero"`` policy (reading it after steps that
        decided on the device makes the host wait for them)."""
        return self._skips.read()

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skips = SkipCount(value)

    @property
    def stats(self) -> dict[str, Any]:
        """Cumulative counters: steps, skipped steps, payload and wire bytes per local worker
        (and what a dense fp32 all-reduce would have cost)."""
        meter = self.comm.meter
        stats = {
            "steps": self.step,
            "skipped_steps": self.skipped_steps,
            "payload_bytes": list(meter.payload),
            "wire_bytes": list(meter.wire),
            "dense_payload_bytes": list(self.dense_payload),
            "dense_wire_bytes": list(self.dense_wire),
            "collective_calls": meter.calls,
            "handshake_bytes": self.handshake_bytes,
        }
        assert tuple(stats) == STATS_KEYS
        return stats
