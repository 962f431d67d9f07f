"""The engine's device path: one call whose non-finite decisions stay on the device.

A mixin of :class:`~gradzip.Engine` (it reads and writes the engine's attributes). On CUDA a
host read of a device value stalls the stream that launches kernels; for compressors whose
collectives' sizes the shapes decide (``Compressor.device_decisions``), the engine keeps each
call's non-finite flag as a 0-d tensor and applies the policy with ``torch.where`` (see
:mod:`gradzip.deferred`), bit for bit what the host path gives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gradzip.comm.base import Collective, allreduce_wire_bytes
from gradzip.comm.header import HEADER_BYTES, HeaderRider
from gradzip.compressors.base import Job, dense_reduce
from gradzip.deferred import any_nonfinite, changed_tensors, where_tree
from gradzip.statecheck import copy_tree, finite_rows

__all__ = ["DevicePath"]


def _or(flag: torch.Tensor | None, more: torch.Tensor) -> torch.Tensor:
    return more if flag is None else flag | more


class DevicePath:
    """The device-decided call of :class:`~gradzip.Engine` (a mixin; see the module
    docstring)."""

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
        self._error_add(jobs)  # before end_step: a controller's levels are this call's
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
                    self._set_states(copy_tree(snap_state))
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
        self._error_commit(dropped=handled)  # a step the policy handled counts zero

    def _settle_device_flags(self) -> None:
        """Bring this step's device flags to the host (a host read), as if every earlier call
        of the step had decided on the host."""
        poison, handled = self._poison_dev, self._handled_dev
        self._poison_dev = self._handled_dev = None
        if handled is not None and bool(handled):
            self._skipped = True
        if poison is not None and bool(poison):
            assert self._snapshot is not None
            self._set_states(copy_tree(self._snapshot[0]))
            self.residuals = dict(self._snapshot[1])
            self._poisoned = self._skipped = True

