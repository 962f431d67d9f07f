"""The one stateful object a user holds: compress, exchange and average gradients.

One :meth:`Engine.reduce` call, top to bottom (every step of it is in this module; the paths
are plain functions over the engine, its :class:`~gradzip.engine.step.Step` and the call):

1. check the gradients and put them in the engine's parameter order;
2. begin the step at its first call (:meth:`Engine._begin`: the configuration handshake
   once, the loss scale followed, a snapshot of the compression state);
3. choose where the call's non-finite decision is read (:meth:`Engine._reduce_call`): on the
   device (:mod:`gradzip.engine.device`), or on the host (:mod:`gradzip.engine.host`), or, for
   a DDP bucket of ``none``/``fp16``/``bf16``, as one flat message (:mod:`gradzip.engine.flat`);
   the non-finite policy (:mod:`gradzip.engine.policy`) acts in the path;
4. commit the call (:meth:`Engine._commit_call`: the call counted; with the step's last call,
   the step counted, skipped or measured) or, on any exception, roll the step back
   (:meth:`Engine._roll_back`: all state as before the step began).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from gradzip._validate import check_bool, check_int
from gradzip.comm.base import Collective
from gradzip.compressors.base import Compressor
from gradzip.engine.base import EngineBase
from gradzip.engine.call import Call, build_jobs, exchange_header, filled
from gradzip.engine.checkpoint import load_state, save_state
from gradzip.engine.device import decides_on_device, reduce_on_device
from gradzip.engine.flat import (
    BucketLayout,
    bucket_layout,
    flat_applies,
    reduce_flat,
    reduce_flat_on_device,
)
from gradzip.engine.host import reduce_on_host
from gradzip.engine.policy import NonfinitePolicy
from gradzip.engine.segments import reduce_segments_on_device, segments_apply
from gradzip.options import EngineOptions

__all__ = ["Engine"]


class Engine(EngineBase):
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
        decide_on: where calls read their non-finite decisions. ``"auto"`` (default): on the
            device for tensors on CUDA where the compressor and policy allow it (no host
            read per call), and a DDP bucket of ``none``/``fp16``/``bf16`` on any device as
            one flat message; the results are the same bit for bit as ``"host"``'s.
            ``"host"``: every call takes the per-tensor host path (the reference the others
            are tested against). ``"device"``: decisions on the device wherever the
            compressor and policy allow it, on any device (how the CUDA path is tested on
            the CPU), DDP buckets flat as with ``"auto"``. Also
            settable as the attribute ``engine.decide_on``.
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
        decide_on: str = "auto",
        **engine_options: Any,
    ) -> None:
        super().__init__(params, compressor, collective=collective, options=options,
                         decide_on=decide_on, **engine_options)
        self._policy = NonfinitePolicy(self.nonfinite)

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
            self._roll_back()
            raise
        return self._run(Call(names, grads, named_grads, finish_step, step, same_layout))

    def _run(self, call: Call) -> dict[str, torch.Tensor]:
        """One checked call, as a transaction: begin, the call, commit (or roll back)."""
        try:
            self._begin()
            out = self._reduce_call(call)
        except BaseException:
            self._roll_back()
            raise
        self._commit_call(call.finish_step)
        return out

    def _begin(self) -> None:
        """Begin the step if this is its first call (and agree with the other ranks once)."""
        if not self._verified:
            self._verify_agreement()
        if not self._step.begun:
            self._follow_loss_scale()
            # Before the step's restore point: a controller's decision (Accordion's) stands
            # even if the step is rolled back, so the step's calls change tensors only and
            # keep their non-finite decisions on the device (no host read per call).
            self._begin_compressors_step()
            self._step.begin(self._save())

    def _reduce_call(self, call: Call) -> dict[str, torch.Tensor]:
        """The call itself: where its decision is read, then that path."""
        step, policy = self._step, self._policy
        on_device = decides_on_device(self, step, call)
        if not on_device and step.decided_on_device:
            policy.settle(self, step)  # this call decides on the host: bring them over
        # Every rank knows it is poisoned together (the earlier call's count was agreed), so
        # every rank sends the separate header here, whatever ``same_layout`` says.
        if step.poisoned:  # an earlier call of this step was non-finite ("skip")
            exchange_header(self, step, call, [False] * self.comm.local_workers)
            return filled(self, call, float("nan"))
        before = policy.restore_point(self, step)
        jobs, dense = build_jobs(self, call)
        path = reduce_on_device if on_device else reduce_on_host
        return path(self, step, policy, call, jobs, dense, before)

    def _commit_call(self, finish_step: bool) -> None:
        """Count a call that completed; the call that finishes the step commits it."""
        self._step.complete_call()
        if not finish_step:
            return
        if self._step.handled:
            self._skips.add(1)
        else:
            self._errors.commit(self._step.error_sums)
        self.step += 1
        self._step.commit()

    def _roll_back(self) -> None:
        """Put all state back to where the step began (after an exception inside it)."""
        saved = self._step.roll_back()
        if saved is not None:
            self._restore(saved)

    # -- DDP buckets -----------------------------------------------------------------------
    def bucket_layout(self, named: Mapping[str, torch.Tensor], buffer: torch.Tensor) -> BucketLayout:
        """A bucket's layout for :meth:`reduce_bucket`: ``named`` checked as :meth:`reduce`
        checks gradients (build it again when the bucket's tensors change).

        Args:
            named: ``name -> gradient``, views into ``buffer``.
            buffer: the bucket's flat buffer.

        Returns:
            The layout.

        Raises:
            TypeError, ValueError: unknown names, wrong shapes or types.
        """
        return bucket_layout(self, named, buffer)

    def reduce_bucket(self, layout: BucketLayout, *, finish_step: bool,
                      step: int | None = None) -> None:
        """Average a DDP bucket's gradients in place: :meth:`reduce` with
        ``same_layout=True``, its averages written back into the bucket, bit for bit (as
        one flat message where that applies, see :mod:`gradzip.engine.flat`). Raises what
        :meth:`reduce` raises.

        Args:
            layout: from :meth:`bucket_layout`.
            finish_step: whether this call completes an optimizer step.
            step: the caller's step number, carried in the header (see :meth:`reduce`); the
                DDP hook passes its count of optimizer steps when it knows the optimizer.
        """
        call = layout.call(finish_step, step)
        on_device = False
        flat = flat_applies(self, self._step, layout)
        if flat:
            on_device = decides_on_device(self, self._step, call)
            # A host decision after device ones must first settle them: the ordinary path.
            flat = on_device or not self._step.decided_on_device
        if not flat:
            try:
                # Begun first: the device decision reads where the step began, and the
                # segment plan may depend on state the step's beginning changes (a decision
                # of Accordion's changes levels, and with them the row's groups).
                self._begin()
                segmented = (segments_apply(self, self._step, layout)
                             and decides_on_device(self, self._step, call))
            except BaseException:
                self._roll_back()
                raise
            if segmented:
                self._run_bucket(reduce_segments_on_device, call, layout, finish_step)
                return
        if not flat:
            # The ordinary call, on the names and worker-axis views checked and ordered once;
            # the averages written back by one multi-tensor copy, and a device decision's
            # mask applied to the whole bucket at once where the gradients tile it.
            call.defer_mask = layout.whole
            averaged = self._run(call)
            torch._foreach_copy_([layout.named[n] for n in averaged], list(averaged.values()))
            if call.mask is not None:
                mask, fill = call.mask
                layout.buffer.masked_fill_(mask, fill)
            return
        self._run_bucket(reduce_flat_on_device if on_device else reduce_flat, call, layout,
                         finish_step)

    def _run_bucket(self, path: Callable[..., None], call: Call, layout: BucketLayout,
                    finish_step: bool) -> None:
        """A bucket's call by one of the paths that write into the bucket themselves, as a
        transaction (as :meth:`_run`)."""
        try:
            self._begin()
            before = self._policy.restore_point(self, self._step)
            path(self, self._step, self._policy, call, layout, before)
        except BaseException:
            self._roll_back()
            raise
        self._commit_call(finish_step)

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

    # -- checkpoints and observability -----------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly: tensors and plain values only.

        Residuals belong to the workers of this process: save one file per rank.

        Returns:
            The state (see :mod:`gradzip.engine.checkpoint`).

        Raises:
            RuntimeError: called inside a step.
        """
        return save_state(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output: validate all of it, then swap it in at once.

        A checkpoint holding NaN or Inf anywhere is refused (it would poison every later
        step); so is one from another parameter set, in either direction. When this raises,
        the engine is unchanged.

        Args:
            state: a :meth:`state_dict` of an engine of the same configuration.

        Raises:
            TypeError: ``state`` is not a mapping.
            ValueError: a missing key (named), another format version, compressor, rules,
                world size, rank or parameter set, a negative or fractional counter, a wrong
                shape or dtype, or a non-finite value (the first problem is named).
        """
        load_state(self, state)

    def compression_error(
        self, *, reset: bool = True, pool: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> dict[str, float | None]:
        """The relative compression error since the last reset: ``sqrt(sum ||e||^2 / sum
        ||x||^2)`` over the steps, compressed tensors and workers of the span, ``x`` a
        compressor's input (gradient plus residual) and ``e`` what it left unsent (see
        :mod:`gradzip.engine.error` for every choice).

        Args:
            reset: start a new span after reading (the training loop reads once per epoch).
            pool: where each process holds its own workers, a function that sums a float64
                tensor over every process (an all-reduce, e.g. ``torch.distributed``'s
                ``all_reduce`` wrapped to return its input): the ratios are then over every
                worker of the group, and every process must call this alike. ``None``: over
                this process's workers (every worker of a simulated group).

        Returns:
            ``compression_error``: the ratio, or ``0.0`` where every compressor is exact and
            no tensor keeps a residual, or ``None`` where it cannot be known (no residual kept
            by a lossy compressor, or no step in the span); with a two-level controller also
            ``compression_error_gentle`` and ``compression_error_aggressive`` (``None`` for a
            level no tensor took in the span). One host read of the device sums.

        Raises:
            TypeError: ``reset`` is not a bool, or ``pool`` is not callable.
        """
        per_level = self.compressor.tensor_levels(self.compressor_state) is not None
        return self._errors.read(per_level=per_level, reset=reset, pool=pool)
