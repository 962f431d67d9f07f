"""The one stateful object a user holds: compress, exchange and average gradients."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from gradzip._validate import check_bool, check_int
from gradzip.checkpoint import validate_checkpoint
from gradzip.comm.base import Collective, allreduce_wire_bytes
from gradzip.comm.header import (
    HEADER_BYTES,
    HeaderRider,
    call_code,
    make_header,
    read_header,
    verify_configuration,
)
from gradzip.comm.torch_dist import default_collective
from gradzip.compressors.base import Compressor, Job, StepContext, dense_reduce
from gradzip.deferred import any_nonfinite, changed_tensors, where_tree
from gradzip.feedback import compensate
from gradzip.ops.random import stable_hash
from gradzip.options import MAIN_ROUTE, NONFINITE_POLICIES, EngineOptions
from gradzip.routing import Router
from gradzip.spec import compressor_from_spec
from gradzip.statecheck import bad_workers, check_tree, finite_rows, first_nonfinite

__all__ = ["FORMAT_VERSION", "NONFINITE_POLICIES", "STATS_KEYS", "Engine"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
#: The keys of :attr:`Engine.stats`.
STATS_KEYS = ("steps", "skipped_steps", "payload_bytes", "wire_bytes", "dense_payload_bytes",
              "dense_wire_bytes", "collective_calls", "handshake_bytes")


def _copy_tree(tree: Any) -> Any:
    """Copy the dict structure of a state tree, sharing its tensors (they are never mutated)."""
    if isinstance(tree, dict):
        return {k: _copy_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_copy_tree(v) for v in tree]
    return tree


# The structural comparison of state trees (kept under its old name for callers and tests).
_first_mismatch = check_tree


def _or(flag: torch.Tensor | None, more: torch.Tensor) -> torch.Tensor:
    return more if flag is None else flag | more


def _zero_rows(tensor: torch.Tensor, bad: list[bool]) -> torch.Tensor:
    """A copy of ``tensor[L, ...]`` with the rows of the workers marked bad set to zero."""
    out = tensor.clone()
    for w, is_bad in enumerate(bad):
        if is_bad:
            out[w] = 0.0
    return out


class Engine:
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

    Example:
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
        self.params: dict[str, torch.Tensor] = {}
        if isinstance(params, nn.Module):
            self.params = {n: p for n, p in params.named_parameters() if p.requires_grad}
            shapes = {n: p.shape for n, p in self.params.items()}
        elif isinstance(params, Mapping):
            shapes = {
                str(n): (v.shape if isinstance(v, torch.Tensor) else torch.Size(v))
                for n, v in params.items()
            }
        elif isinstance(params, Iterable) and not isinstance(params, (str, torch.Tensor)):
            self.params = {str(n): p for n, p in params}
            shapes = {n: p.shape for n, p in self.params.items()}
        else:
            raise TypeError(
                f"`params` must be a module, (name, parameter) pairs or a name->shape mapping, "
                f"got {type(params).__name__}"
            )
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
            if not self._verified:
                self._verify_agreement()
            if self._snapshot is None:
                self._follow_loss_scale()
                self._snapshot = (_copy_tree(self._states()), dict(self.residuals))
            out = self._reduce_call(names, grads, named_grads, finish_step, step, same_layout)
        except BaseException:
            self._abort_step()
            raise
        self._call += 1
        if finish_step:
            if self._skipped:
                self.skipped_steps += 1
            self.step += 1
            self._reset_step()
        return out

    def _follow_loss_scale(self) -> None:
        """Bring residuals to the scaler's current loss scale (at the start of a step)."""
        if self.grad_scaler is None or not self.grad_scaler.is_enabled():
            return
        scale = float(self.grad_scaler.get_scale())
        if self.residual_scale is not None and scale != self.residual_scale:
            ratio = scale / self.residual_scale
            self.residuals = {n: r * ratio for n, r in self.residuals.items()}
        self.residual_scale = scale

    def _call_code(self, names: list[str], finish_step: bool, user_step: int | None) -> int:
        set_code = sum(self._name_codes[n] for n in names) % (1 << 64)
        return call_code(self.step, self._call, finish_step, user_step, set_code, len(names))

    def _out_of_step(self, names: list[str], finish_step: bool, user_step: int | None) -> None:
        shown = ", ".join(f"{n}{tuple(self.shapes[n])}" for n in names[:4])
        raise RuntimeError(
            f"ranks are out of step: rank {self.comm.first_rank} makes call {self._call} of "
            f"step {self.step} (finish_step={finish_step}, step={user_step}) with "
            f"{len(names)} tensors [{shown}{', ...' if len(names) > 4 else ''}], and at "
            f"least one other rank makes a different call (another step or call of the "
            f"step, or another set of tensors or shapes); every rank must make the same "
            f"sequence of reduce calls with the same tensors. The step was abandoned."
        )

    def _exchange_header(
        self, names: list[str], finish_step: bool, user_step: int | None, bad: list[bool]
    ) -> bool:
        """Check that every rank makes this very call; return whether any worker's
        compensated gradient is non-finite (so every worker applies the policy alike)."""
        code = self._call_code(names, finish_step, user_step)
        total = self.comm.all_reduce(make_header(code, bad))
        agreed, nonfinite = read_header(total, self.comm.world_size)
        if not agreed:
            self._out_of_step(names, finish_step, user_step)
        return nonfinite

    def _reduce_call(
        self,
        names: list[str],
        grads: list[torch.Tensor],
        named_grads: Mapping[str, torch.Tensor],
        finish_step: bool,
        user_step: int | None,
        same_layout: bool = False,
    ) -> dict[str, torch.Tensor]:
        workers, world = self.comm.local_workers, self.comm.world_size
        on_device = self._decides_on_device(names, grads, same_layout)
        if not on_device and self._poison_dev is not None:
            self._settle_device_flags()  # this call decides on the host: bring them over
        # Every rank knows it is poisoned together (the earlier call's count was agreed), so
        # every rank sends the separate header here, whatever ``same_layout`` says.
        if self._poisoned:  # an earlier call of this step was non-finite ("skip")
            self._exchange_header(names, finish_step, user_step, [False] * workers)
            return self._fill(names, named_grads, float("nan"))
        # What "zero" restores: the state before this call (other policies go back to the
        # step's start, and leaves unchanged since then need no second finiteness test).
        before = (
            (_copy_tree(self._states()), dict(self.residuals))
            if self.nonfinite == "zero" else self._snapshot
        )
        assert before is not None
        jobs, dense = [], []
        for name, g in zip(names, grads, strict=True):
            if name in self.dense_names:
                dense.append(Job(name, g.to(torch.float32)))
            else:
                if name in self._feedback:
                    # raw: the gradient before error feedback, for controllers that judge the
                    # training regime from it (Accordion); a reference, no copy.
                    jobs.append(Job(name, compensate(g, self.residuals.get(name)), raw=g))
                else:
                    # No residual is ever kept from it, and compressors only read a job's
                    # tensor: the gradient itself (in fp32) serves, no copy.
                    jobs.append(Job(name, g.to(torch.float32), raw=g))
        if on_device:
            return self._reduce_on_device(
                names, jobs, dense, named_grads, before, finish_step, user_step, same_layout
            )
        # The compensated gradient, not only the incoming one: a finite gradient plus a finite
        # residual can overflow, and that must not reach the compressor or the state.
        bad = bad_workers([j.tensor for j in jobs + dense], workers)
        if same_layout:
            # The agreement rides in the payload, so it is known only after the compressor
            # has started sending: a worker whose gradient is non-finite sends zeros instead
            # (compressors are handed finite tensors only; the result is discarded by the
            # policy on every worker alike, and zeros keep every message's size).
            if any(bad):
                jobs = [Job(j.name, _zero_rows(j.tensor, bad)) for j in jobs]
                dense = [Job(j.name, _zero_rows(j.tensor, bad)) for j in dense]
            rider = HeaderRider(
                self.comm, self._call_code(names, finish_step, user_step), bad,
                lambda: self._out_of_step(names, finish_step, user_step),
            )
            dense_reduce(dense, rider)
            self._reduce_routed(jobs, rider)
            if rider.finish():
                return self._on_nonfinite(
                    names, named_grads, before, finish_step, "a gradient holds NaN or Inf",
                )
        else:
            if self._exchange_header(names, finish_step, user_step, bad):
                return self._on_nonfinite(
                    names, named_grads, before, finish_step,
                    "a gradient holds NaN or Inf",
                )
            dense_reduce(dense, self.comm)
            self._reduce_routed(jobs, self.comm)
        dense_bytes = 4 * sum(j.numel for j in jobs + dense)
        for w in range(workers):
            self.dense_payload[w] += dense_bytes
            self.dense_wire[w] += allreduce_wire_bytes(dense_bytes, world)
        averaged = {job.name: job.averaged for job in jobs + dense}
        assert all(a is not None for a in averaged.values()), names
        # The average and the compressor's state are identical on every worker (both come from
        # aggregated quantities), so testing them locally takes the same decision everywhere.
        # Residuals are per worker: compressors guarantee they are finite whenever the
        # compensated gradient and the average are (see ``Compressor.reduce``).
        overflow = first_nonfinite(  # one host read for the average and the state together
            {"average": averaged, **self._state_tree(self._states())}, "",
            self._state_tree(before[0]),
        )
        if overflow is None:
            for job in jobs:
                if job.name in self._feedback:
                    self.residuals[job.name] = job.leftover()
            if finish_step:
                overflow = self._end_step(before[0])
        if overflow is not None:
            return self._on_nonfinite(
                names, named_grads, before, finish_step,
                f"compression overflowed in {overflow.lstrip('.')}",
            )
        return {
            job.name: job.averaged.to(named_grads[job.name].dtype)  # type: ignore[union-attr]
            for job in sorted(jobs + dense, key=lambda j: self._order[j.name])
        }

    def _end_step(self, before: list[Any]) -> str | None:
        """Run every compressor's end of step; where a state turns non-finite, the path."""
        self._router.end_step(self._states(), self._context())
        where = first_nonfinite(self._state_tree(self._states()), "", self._state_tree(before))
        return None if where is None else where.lstrip(".")

    # -- decisions kept on the device (see gradzip.deferred) -------------------------------
    def _decides_on_device(
        self, names: list[str], grads: list[torch.Tensor], same_layout: bool
    ) -> bool:
        """Whether this call keeps its non-finite decisions on the device (no host read).

        Only where every condition holds: the tensors live on CUDA (on the CPU a host read
        costs nothing, and the host path sends less after a non-finite call); the policy
        is not ``"raise"`` (an exception needs the host to know now); the compressor's
        collectives have shape-determined sizes and tolerate non-finite input
        (``device_decisions``), so ranks may learn of a non-finite gradient after its
        message was sent; nothing needs the header read before the payload (every worker is
        in this process, or the header rides in a payload of guaranteed layout); and every
        compressed tensor has a residual to restore (steady state).
        """
        if not (self._device_decisions or (grads and grads[0].is_cuda)):
            return False
        if self.rule_compressors:  # several compressors' states: decided on the host
            return False
        if self.nonfinite == "raise" or not self.compressor.device_decisions or not grads:
            return False
        if not (same_layout or self.comm.simulated or self.comm.world_size == 1):
            return False
        if self._poisoned:  # decided on the host already: the host path goes on
            return False
        if not self.error_feedback:
            return True
        target = self.residuals if self.nonfinite == "zero" else self._snapshot[1]  # type: ignore[index]
        return all(n in target for n in names if n not in self.dense_names)

    def _reduce_on_device(
        self,
        names: list[str],
        jobs: list[Job],
        dense: list[Job],
        named_grads: Mapping[str, torch.Tensor],
        before: tuple[Any, dict[str, torch.Tensor]],
        finish_step: bool,
        user_step: int | None,
        same_layout: bool,
    ) -> dict[str, torch.Tensor]:
        """One call whose non-finite decisions stay on the device (``_decides_on_device``).

        The same results, state and counters as the host path, bit for bit, by
        ``torch.where`` on a 0-d flag: ``"skip"`` masks this and every later call of the step
        with NaN and, at the step's end, restores every residual and state tensor the step
        changed; ``"zero"`` masks the call with zeros and restores its own residuals and
        state at once. Differences: no warning is logged (``stats["skipped_steps"]`` still
        counts), and a call made after a non-finite one sends its payload (the host path
        sends only the header), so byte counts differ in such steps. Ranks out of step
        (only possible in a real group, with the header riding) raise at the end of the
        step, on every rank, with the step abandoned.
        """
        workers, world = self.comm.local_workers, self.comm.world_size
        tensors = [j.tensor for j in jobs + dense]
        device = tensors[0].device
        ok = finite_rows(tensors, workers)
        comm: Collective = self.comm
        rider = None
        if same_layout:
            rider = HeaderRider(
                self.comm, self._call_code(names, finish_step, user_step), ~ok,
                lambda: self._out_of_step(names, finish_step, user_step),
            )
            comm = rider
        else:
            # Every worker is in this process (``_decides_on_device``), so they make the same
            # call by construction and their non-finite agreement is the local "any". The
            # header is counted as the real group would send it, so byte counts match.
            wire = allreduce_wire_bytes(HEADER_BYTES, world)
            self.comm.meter.add([HEADER_BYTES] * workers, [wire] * workers)
        dense_reduce(dense, comm)
        if jobs:
            self.compressor.reduce(jobs, self.compressor_state, comm, self._context())
        if rider is not None:
            bad = rider.finish_on_device(device)
            if rider.disagree is not None and not (self.comm.simulated or world == 1):
                self._desync_dev = _or(self._desync_dev, rider.disagree)
        else:
            bad = ~ok.all()
        dense_bytes = 4 * sum(j.numel for j in jobs + dense)
        for w in range(workers):
            self.dense_payload[w] += dense_bytes
            self.dense_wire[w] += allreduce_wire_bytes(dense_bytes, world)
        averaged = [job.averaged for job in jobs + dense]
        changed = changed_tensors(self.compressor_state, before[0][0])
        if changed is None:  # a compressor's bug; the step is abandoned
            raise RuntimeError(
                f"{self.compressor.spec()} changed its state in a way a device rollback "
                "cannot undo; it must not declare device_decisions"
            )
        flag = bad | any_nonfinite([*averaged, *changed], device)  # type: ignore[list-item]
        if self.error_feedback:
            for job in jobs:
                rest = job.leftover()
                if self.nonfinite == "zero":
                    rest = torch.where(flag, before[1][job.name], rest)
                self.residuals[job.name] = rest
        if self.nonfinite == "zero":
            self.compressor_state = where_tree(flag, before[0][0], self.compressor_state)
            self._handled_dev = _or(self._handled_dev, flag)
            mask, fill = flag, 0.0
        else:
            self._poison_dev = _or(self._poison_dev, flag)
            mask, fill = self._poison_dev, float("nan")
        if finish_step:
            self._finish_on_device(device)
        return {
            job.name: torch.where(mask, fill, job.averaged.to(named_grads[job.name].dtype))  # type: ignore[union-attr]
            for job in sorted(jobs + dense, key=lambda j: self._order[j.name])
        }

    def _finish_on_device(self, device: torch.device) -> None:
        """The end of a step whose decisions are on the device: the compressor's end of step,
        the rollback of ``"skip"``, the skipped-step count; then the one host read of a step
        whose header rode in a real group (ranks out of step)."""
        start = self.compressor_state
        self.compressor.end_step(self.compressor_state, self._context())
        changed = changed_tensors(self.compressor_state, start)
        if changed is None:
            raise RuntimeError(
                f"{self.compressor.spec()} changed its state at the end of a step in a way a "
                "device rollback cannot undo; it must not declare device_decisions"
            )
        end_bad = any_nonfinite(changed, device)
        if self.nonfinite == "zero":
            self.compressor_state = where_tree(end_bad, start, self.compressor_state)
            handled = _or(self._handled_dev, end_bad)
        else:
            assert self._snapshot is not None
            poison = _or(self._poison_dev, end_bad)
            snap_state, snap_res = self._snapshot
            if any(n not in snap_res for n in self.residuals):
                # A residual made this step by a call that decided on the host has nothing to
                # go back to on the device: decide on the host (first steps only).
                if bool(poison):
                    self._set_states(_copy_tree(snap_state))
                    self.residuals = dict(snap_res)
            else:
                self.compressor_state = where_tree(poison, snap_state[0], self.compressor_state)
                self.residuals = {
                    n: r if r is snap_res[n] else torch.where(poison, snap_res[n], r)
                    for n, r in self.residuals.items()
                }
            handled = poison
        count = handled.to(torch.int64)
        self._skipped_pending = count if self._skipped_pending is None else self._skipped_pending + count
        self._poison_dev = self._handled_dev = None
        if self._desync_dev is not None:
            # Why only now: with the header riding in a payload of guaranteed layout, and
            # collectives whose sizes the shapes decide, ranks out of step exchange messages of
            # equal sizes (nothing aborts); reading once per step instead of once per call
            # keeps the host from waiting on every bucket. Every rank reads the same sums.
            desync, self._desync_dev = bool(self._desync_dev), None
            if desync:
                raise RuntimeError(
                    f"ranks are out of step: at least one call of step {self.step} on rank "
                    f"{self.comm.first_rank} differed from another rank's (another step or "
                    f"call of the step); every rank must make the same sequence of reduce "
                    f"calls. Found at the step's end; the step was abandoned."
                )

    def _settle_device_flags(self) -> None:
        """Bring this step's device flags to the host (a host read), as if every earlier call
        of the step had decided on the host."""
        poison, handled = self._poison_dev, self._handled_dev
        self._poison_dev = self._handled_dev = None
        if handled is not None and bool(handled):
            self._skipped = True
        if poison is not None and bool(poison):
            assert self._snapshot is not None
            self._set_states(_copy_tree(self._snapshot[0]))
            self.residuals = dict(self._snapshot[1])
            self._poisoned = self._skipped = True

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

    def _fill(
        self, names: list[str], named_grads: Mapping[str, torch.Tensor], value: float
    ) -> dict[str, torch.Tensor]:
        return {
            n: torch.full(self.shapes[n], value, dtype=named_grads[n].dtype, device=named_grads[n].device)
            for n in names
        }

    def _on_nonfinite(
        self,
        names: list[str],
        named_grads: Mapping[str, torch.Tensor],
        before: tuple[Any, dict[str, torch.Tensor]],
        finish_step: bool,
        what: str,
    ) -> dict[str, torch.Tensor]:
        """Apply the non-finite policy to this call (every worker reaches it together).

        ``skip``: the whole step is rolled back and this call and every later call of the step
        return NaN, so the step's gradient is non-finite and the optimizer step is skipped.
        ``zero``: this call is dropped (its tensors' state is as before the call, its result
        zeros); earlier and later calls of the step stand. ``raise``: the step is abandoned.
        """
        shown = f"{names[:5]}{'...' if len(names) > 5 else ''}"
        if self.nonfinite == "raise":
            raise FloatingPointError(
                f"{what} at step {self.step} (on at least one worker; a gradient plus its "
                f"residual that overflows counts as non-finite); tensors in this call: {shown}"
            )
        log.warning("%s at step %d (tensors %s): handled by nonfinite=%r",
                    what, self.step, shown, self.nonfinite)
        self._skipped = True
        if self.nonfinite == "skip":
            assert self._snapshot is not None
            self._set_states(_copy_tree(self._snapshot[0]))
            self.residuals = dict(self._snapshot[1])
            self._poisoned = True
            return self._fill(names, named_grads, float("nan"))
        self._set_states(_copy_tree(before[0]))
        self.residuals = dict(before[1])
        if finish_step and self._end_step(before[0]) is not None:
            self._set_states(_copy_tree(before[0]))  # the end of step itself overflows
        return self._fill(names, named_grads, 0.0)

    def _abort_step(self) -> None:
        """Put all state back to where the step began (after an exception inside it)."""
        if self._snapshot is not None:
            self._set_states(self._snapshot[0])
            self.residuals = self._snapshot[1]
        self._reset_step()

    def _reset_step(self) -> None:
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

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly: tensors and plain values only.

        Residuals belong to the workers of this process: save one file per rank.
        """
        if self._snapshot is not None:
            raise RuntimeError("state_dict() must be called between steps, not inside one")
        return {
            **self._checkpoint_config(),
            "parameters": {n: list(s) for n, s in self.shapes.items()},
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "residual_scale": self.residual_scale,
            "residuals": {n: r.clone() for n, r in self.residuals.items()},
            "compressor_state": _copy_tree(self.compressor_state),
            "rule_states": _copy_tree(self.rule_states),
            "meter": self.comm.meter.snapshot(),
            "dense_payload": list(self.dense_payload),
            "dense_wire": list(self.dense_wire),
        }

    def _checkpoint_config(self) -> dict[str, Any]:
        """The configuration a checkpoint records and a load must match, field by field."""
        return {
            "format_version": FORMAT_VERSION,
            "compressor": self.compressor.spec(),
            "error_feedback": self.error_feedback,
            "dense_1d": self.dense_1d,
            "rules": self._rule_specs(),
            "min_numel": self.options.min_numel,
            "world_size": self.comm.world_size,
            "ranks": list(self.comm.local_ranks),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output: validate all of it, then swap it in at once.

        A checkpoint holding NaN or Inf anywhere is refused (it would poison every later
        step); so is one from another parameter set, in either direction. When this raises,
        the engine is unchanged.

        Raises:
            TypeError: ``state`` is not a mapping.
            ValueError: a missing key (named), another format version, compressor, rules,
                world size, rank or parameter set, a negative or fractional counter, a wrong shape or
                dtype, or a non-finite value (the first problem is named).
        """
        loaded = validate_checkpoint(
            state,
            config=self._checkpoint_config(),
            shapes=self.shapes,
            dense_names=self.dense_names,
            feedback_names=self._feedback,
            workers=self.comm.local_workers,
            fresh_state=self.compressor.init_state(self._compressed_shapes()),
            fresh_rule_states=self._router.fresh_rule_states(),
        )
        # Everything is valid: swap it in.
        self.step, self.skipped_steps = loaded.step, loaded.skipped_steps
        self.residual_scale = loaded.residual_scale
        self.residuals = loaded.residuals
        self.compressor_state = _copy_tree(loaded.compressor_state)
        self.rule_states = _copy_tree(loaded.rule_states)
        self.comm.meter.load(loaded.meter)
        self.dense_payload, self.dense_wire = loaded.dense_payload, loaded.dense_wire
        self._reset_step()
