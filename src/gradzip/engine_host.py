"""The engine's host path: one call whose non-finite decision is read on the host.

A mixin of :class:`~gradzip.Engine` (it reads and writes the engine's attributes): the call
header and its agreement check, the payload's exchange through the compressor, the
finiteness tests of the average and the state, and the non-finite policy. The default path
everywhere but on CUDA with device-friendly compressors (see :mod:`gradzip.engine_device`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from gradzip.comm.base import allreduce_wire_bytes
from gradzip.comm.header import HeaderRider, call_code, make_header, read_header
from gradzip.compressors.base import Job, dense_reduce
from gradzip.feedback import compensate
from gradzip.statecheck import bad_workers, copy_tree, first_nonfinite

__all__ = ["HostPath"]

log = logging.getLogger("gradzip.engine")


def _zero_rows(tensor: torch.Tensor, bad: list[bool]) -> torch.Tensor:
    """A copy of ``tensor[L, ...]`` with the rows of the workers marked bad set to zero."""
    out = tensor.clone()
    for w, is_bad in enumerate(bad):
        if is_bad:
            out[w] = 0.0
    return out


class HostPath:
    """The host-decided call of :class:`~gradzip.Engine` (a mixin; see the module docstring)."""

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
            (copy_tree(self._states()), dict(self.residuals))
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
            self._error_add(jobs)  # before end_step: a controller's levels are this call's
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
            self._set_states(copy_tree(self._snapshot[0]))
            self.residuals = dict(self._snapshot[1])
            self._poisoned = True
            return self._fill(names, named_grads, float("nan"))
        self._set_states(copy_tree(before[0]))
        self.residuals = dict(before[1])
        if finish_step and self._end_step(before[0]) is not None:
            self._set_states(copy_tree(before[0]))  # the end of step itself overflows
        return self._fill(names, named_grads, 0.0)

