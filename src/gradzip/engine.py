"""The one stateful object a user holds: compress, exchange and average gradients."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from gradzip._validate import check_bool, check_grad_dtype, check_int, named_params_and_shapes
from gradzip.comm.base import Collective
from gradzip.comm.header import verify_configuration
from gradzip.comm.torch_dist import default_collective
from gradzip.compressors.base import Compressor, Job, StepContext
from gradzip.engine_checkpoint import FORMAT_VERSION, EngineCheckpoints
from gradzip.engine_device import DevicePath
from gradzip.engine_error import ErrorMeter
from gradzip.engine_flat import FlatPath
from gradzip.engine_host import HostPath
from gradzip.ops.random import stable_hash
from gradzip.options import MAIN_ROUTE, NONFINITE_POLICIES, EngineOptions
from gradzip.routing import Router
from gradzip.spec import compressor_from_spec
from gradzip.statecheck import check_tree, copy_tree

__all__ = ["FORMAT_VERSION", "NONFINITE_POLICIES", "STATS_KEYS", "Engine"]

#: The keys of :attr:`Engine.stats`.
STATS_KEYS = ("steps", "skipped_steps", "payload_bytes", "wire_bytes", "dense_payload_bytes",
              "dense_wire_bytes", "collective_calls", "handshake_bytes")

# Kept under their old names for callers and tests: the structure-sharing copy of a state
# tree, and the structural comparison of state trees.
_copy_tree = copy_tree
_first_mismatch = check_tree


class Engine(HostPath, DevicePath, FlatPath, EngineCheckpoints, ErrorMeter):
    """Compressed gradient averaging with error feedback, for real or simulated workers.

    Args:
        params: the model (its trainable named parameters), an iterable of ``(name, param)``,
            or a mapping ``name -> shape`` (or ``name -> tensor``).
        compressor: a :class:`~gradzip.Compressor`, a spec string such as
            ``"topk:ratio=0.01"``, or an :class:`~gradzip.Accordion`.
        collective: where workers meet: a :class:`~gradzip.SimulatedGroup` (gradients then
            carry a leading worker axis) or a process group; default the world group, or a
            single worker when ``torch.distributed`` is not initialised.
        options: an :class:`~gradzip.EngineOptions` (error feedback, non-finite policy,
            optimizer, grad scaler, ``dense_1d``, per-parameter ``rules``, ``min_numel``:
            documented there).
        **engine_options: the same options as keywords (they replace the record's fields).

    Raises:
        TypeError, ValueError: invalid arguments, naming the parameter.

    Examples:
        >>> engine = Engine(model, "powersgd:rank=2")
        >>> loss.backward(); engine.reduce_()   # averaged, compressed gradients in .grad
    """

    def __init__(
        self,
        params: nn.Module | Iterable[tuple[str, torch.Tensor]] | Mapping[str, Any],
        compressor: Compressor | str,
        *,
        collective: Collective | None = None,
        options: EngineOptions | None = None,
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
        self.skipped_steps = 0
        self.dense_payload = [0] * self.comm.local_workers
        self.dense_wire = [0] * self.comm.local_workers
        self.residuals: dict[str, torch.Tensor] = {}
        self.compressor_state = self.compressor.init_state(self._compressed_shapes())
        #: Each rule's compressor state (``{}`` for a dense rule), in rule order.
        self.rule_states: list[Any] = self._router.fresh_rule_states()
        self._snapshot: tuple[Any, ...] | None = None
        self._poisoned = False  # "skip": an earlier call of this step was non-finite
        self._skipped = False  # the policy handled a call of this step
        self._call = 0  # calls made so far in this step
        # Decisions kept on the device (``_reduce_on_device``): this step's "skip" flag,
        # "zero" flag, ranks-out-of-step flag (0-d bool tensors), and skipped steps not yet
        # added to ``skipped_steps``. ``_device_decisions`` forces that path off CUDA too.
        self._poison_dev: torch.Tensor | None = None
        self._handled_dev: torch.Tensor | None = None
        self._desync_dev: torch.Tensor | None = None
        self._skipped_pending: torch.Tensor | None = None
        self._device_decisions = False
        self._name_codes = {n: stable_hash("tensor", n, tuple(s)) for n, s in self.shapes.items()}
        self._verified = self.comm.simulated or self.comm.world_size == 1
        self.handshake_bytes = 0
        self._error_reset()  # the compression-error sums (gradzip.engine_error)

    # -- routing: which compressor reduces which tensor (see gradzip.routing) ---------------
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

    # Every compressor's state as one tree (snapshots, rollback, finiteness tests).
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
        }

    def _rule_specs(self) -> list[str]:
        return [rule.describe() for rule in self.options.rules]

    def _verify_agreement(self) -> None:
        """Check once, before the first step, that every rank runs the same configuration on
        the same parameters (counted in ``stats["handshake_bytes"]``)."""
        self.handshake_bytes += verify_configuration(self.comm, self._fingerprint())
        self._verified = True

    # -- the step --------------------------------------------------------------------------
    def reduce(
        self,
        named_grads: Mapping[str, torch.Tensor],
        *,
        finish_step: bool = True,
        step: int | None = None,
        same_layout: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Average gradients over all workers through the compressor.

        Every call first exchanges a small fixed-size header (see :mod:`gradzip.comm.header`)
        so that ranks making different calls (another step, another call of the step, another
        set of tensors or shapes) fail together with a clear error instead of aborting in a
        size-mismatched collective or averaging different steps. With ``same_layout=True``
        the header rides inside the call's first payload message instead (no collective of
        its own).

        Args:
            named_grads: ``name -> gradient`` (with a leading worker axis in a simulated
                group). Not modified.
            finish_step: whether this call completes an optimizer step (a DDP hook passes
                ``False`` for every bucket but the last).
            step: the caller's step number (e.g. the training loop's index), optional. When
                given it is part of the header, so a rank that skipped a whole step is caught
                at its next call; the engine's own counters catch everything else.
            same_layout: the caller guarantees that every rank's call passes tensors of the
                same names and shapes whenever the ranks are in step (a DDP hook: DDP checks
                its parameters across ranks and hands every rank the same buckets in the same
                order). Ranks out of step are still detected; ranks whose tensors differ
                would send payloads of different sizes (gloo aborts the process), which is
                why this is off by default.

        Returns:
            ``name -> averaged gradient`` in each gradient's dtype, identical on all workers.

        Raises:
            TypeError, ValueError: unknown names, wrong shapes or types.
            FloatingPointError: a non-finite gradient, or an overflow inside compression,
                with ``nonfinite="raise"`` (on every rank).
            RuntimeError: ranks are out of step (on every rank).

        An exception inside a step aborts the step: all state is as it was before the step
        began, and :meth:`state_dict` works.
        """
        if not isinstance(named_grads, Mapping):
            raise TypeError(f"`named_grads` must be a mapping name -> tensor, got {type(named_grads).__name__}")
        check_bool("finish_step", finish_step)
        check_bool("same_layout", same_layout)
        if step is not None:
            step = check_int("step", step, minimum=0)
        try:
            # The engine's own parameter order, not the caller's: DDP hands a bucket's tensors
            # in an order that changes when it rebuilds its buckets, and the layout of the
            # flat buffers decides which worker adds which element first in a ring
            # all-reduce. A fixed layout keeps a resumed run bit-identical to an
            # uninterrupted one.
            names = sorted(named_grads, key=lambda n: self._order.get(n, -1))
            grads = [self._as_worker_axis(n, named_grads[n]) for n in names]
        except BaseException:
            self._abort_step()
            raise
        return self._reduce_sorted(names, grads, named_grads, finish_step, step, same_layout)

    def _reduce_sorted(
        self,
        names: list[str],
        grads: list[torch.Tensor],
        named_grads: Mapping[str, torch.Tensor],
        finish_step: bool,
        step: int | None,
        same_layout: bool,
    ) -> dict[str, torch.Tensor]:
        """:meth:`reduce` of checked gradients: ``names`` in the engine's order, ``grads``
        with their worker axis."""
        try:
            if not self._verified:
                self._verify_agreement()
            if self._snapshot is None:
                self._follow_loss_scale()
                self._snapshot = (copy_tree(self._states()), dict(self.residuals))
            out = self._reduce_call(names, grads, named_grads, finish_step, step, same_layout)
        except BaseException:
            self._abort_step()
            raise
        self._end_call(finish_step)
        return out

    def _end_call(self, finish_step: bool) -> None:
        """Count a call that completed (and the step, with the call that finishes it)."""
        self._call += 1
        if finish_step:
            if self._skipped:
                self.skipped_steps += 1
            else:
                self._error_commit()
            self.step += 1
            self._reset_step()

    def _follow_loss_scale(self) -> None:
        """Bring residuals to the scaler's current loss scale (at the start of a step)."""
        if self.grad_scaler is None or not self.grad_scaler.is_enabled():
            return
        scale = float(self.grad_scaler.get_scale())
        if self.residual_scale is not None and scale != self.residual_scale:
            ratio = scale / self.residual_scale
            self.residuals = {n: r * ratio for n, r in self.residuals.items()}
        self.residual_scale = scale

    @property
    def skipped_steps(self) -> int:
        """Steps handled by the ``"skip"`` or ``"zero"`` policy (reading it after steps that
        decided on the device makes the host wait for them)."""
        if self._skipped_pending is not None:
            self._skipped_host += int(self._skipped_pending)
            self._skipped_pending = None
        return self._skipped_host

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped_host, self._skipped_pending = int(value), None

    def _abort_step(self) -> None:
        """Put all state back to where the step began (after an exception inside it)."""
        if self._snapshot is not None:
            self._set_states(self._snapshot[0])
            self.residuals = self._snapshot[1]
        self._reset_step()

    def _reset_step(self) -> None:
        self._error_pending = [None, None, None]
        self._snapshot = None
        self._poison_dev = self._handled_dev = self._desync_dev = None
        self._poisoned = False
        self._skipped = False
        self._call = 0

    def reduce_(self, *, step: int | None = None) -> None:
        """Replace ``.grad`` of the engine's parameters by the averaged, compressed gradients.

        Parameters without a gradient are skipped (every worker must skip the same ones).

        Args:
            step: the caller's step number, optional (see :meth:`reduce`).

        Raises:
            RuntimeError: the engine was built from shapes, or holds simulated workers.
        """
        if not self.params or self.simulated:
            raise RuntimeError(
                "reduce_() needs an engine built from parameters in a real (one worker per "
                "process) group; use reduce() with named gradients otherwise"
            )
        grads = {n: p.grad for n, p in self.params.items() if p.grad is not None}
        for name, avg in self.reduce(grads, step=step).items():
            self.params[name].grad.copy_(avg)

    # -- observability ---------------------------------------------------------------------
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

