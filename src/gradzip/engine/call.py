"""One call of a step: its record, and the fragments every path shares.

A call is one :meth:`~gradzip.Engine.reduce` (or one DDP bucket): a set of gradients, whether
it finishes the optimizer step, and how its header travels. The paths
(:mod:`~gradzip.engine.host`, :mod:`~gradzip.engine.device`, :mod:`~gradzip.engine.flat`)
differ in where they read the non-finite decision; what they have in common is written once
here: the call's code and the out-of-step error, the header (apart or riding), the jobs,
the dense byte accounting, the averages handed back, and the compressors' end of step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

import torch

from gradzip.comm.base import allreduce_wire_bytes
from gradzip.comm.header import HeaderRider, call_code, make_header, read_header
from gradzip.compressors.base import Job
from gradzip.engine.base import EngineBase
from gradzip.engine.step import Step
from gradzip.feedback import as_fp32, compensate
from gradzip.ops.flat import pack, unpack_like
from gradzip.statecheck import first_nonfinite

__all__ = [
    "Call", "build_jobs", "count_dense", "end_compressors_step", "exchange_header", "filled",
    "header_rider", "masked", "out_of_step", "results", "set_code",
]


@dataclass
class Call:
    """One call of a step.

    Attributes:
        names: the tensors' names, in the engine's parameter order.
        grads: their gradients with the worker axis, in ``names`` order.
        named_grads: the caller's ``name -> gradient`` (for dtypes, devices, write-back).
        finish_step: whether this call completes the optimizer step.
        user_step: the caller's step number, or ``None``.
        same_layout: whether the header may ride in the payload (see
            :meth:`~gradzip.Engine.reduce`).
    """

    names: list[str]
    grads: list[torch.Tensor]
    named_grads: Mapping[str, torch.Tensor]
    finish_step: bool
    user_step: int | None
    same_layout: bool
    #: Set by the caller: the results may come back unmasked with the device form's mask
    #: left in ``mask`` (a DDP bucket applies it to its whole buffer in one op).
    defer_mask: bool = False
    #: Where the device form left the results unmasked: ``(mask, fill)``, results are
    #: ``fill`` where the 0-d ``mask`` holds.
    mask: tuple[torch.Tensor, float] | None = None


def set_code(engine: EngineBase, names: Sequence[str]) -> int:
    """The names' part of a call code (see :mod:`gradzip.comm.header`)."""
    return sum(engine._name_codes[n] for n in names) % (1 << 64)


def code_of(engine: EngineBase, step: Step, call: Call, names_code: int | None = None) -> int:
    """The code every rank must agree on for this call (``names_code``: :func:`set_code` of
    ``call.names``, where already known)."""
    if names_code is None:
        names_code = set_code(engine, call.names)
    return call_code(engine.step, step.call, call.finish_step, call.user_step, names_code,
                     len(call.names))


def out_of_step(engine: EngineBase, step: Step, call: Call) -> NoReturn:
    """Raise the error of ranks that make different calls (on every rank alike)."""
    names = call.names
    shown = ", ".join(f"{n}{tuple(engine.shapes[n])}" for n in names[:4])
    raise RuntimeError(
        f"ranks are out of step: rank {engine.comm.first_rank} makes call {step.call} of "
        f"step {engine.step} (finish_step={call.finish_step}, step={call.user_step}) with "
        f"{len(names)} tensors [{shown}{', ...' if len(names) > 4 else ''}], and at "
        f"least one other rank makes a different call (another step or call of the "
        f"step, or another set of tensors or shapes); every rank must make the same "
        f"sequence of reduce calls with the same tensors. The step was abandoned."
    )


def exchange_header(engine: EngineBase, step: Step, call: Call, bad: list[bool]) -> bool:
    """Send the call's header apart (one small all-reduce): check that every rank makes this
    very call; return whether any worker's compensated gradient is non-finite (so every
    worker applies the policy alike)."""
    total = engine.comm.all_reduce(make_header(code_of(engine, step, call), bad))
    agreed, nonfinite = read_header(total, engine.comm.world_size)
    if not agreed:
        out_of_step(engine, step, call)
    return nonfinite


def header_rider(
    engine: EngineBase, step: Step, call: Call, bad: list[bool] | torch.Tensor
) -> HeaderRider:
    """A collective that carries the call's header inside its first payload message."""
    return HeaderRider(engine.comm, code_of(engine, step, call), bad,
                       lambda: out_of_step(engine, step, call))


def build_jobs(engine: EngineBase, call: Call) -> tuple[list[Job], list[Job]]:
    """The call's compressed jobs (compensated by their residuals where they keep one) and
    its dense ones (routed to one exact all-reduce)."""
    jobs: list[Job | None] = []
    dense = []
    # Gradients with a residual: compensated together by one multi-tensor add (one launch
    # on a GPU for the call instead of one per tensor; elementwise the same as
    # ``compensate``'s ``grad32 + residual``).
    at: list[tuple[int, str, torch.Tensor]] = []
    grads32, residuals = [], []
    dense_names, feedback, kept = engine.dense_names, engine._feedback, engine.residuals
    for name, g in zip(call.names, call.grads, strict=True):
        if name in dense_names:
            dense.append(Job(name, as_fp32(g)))
        elif name in feedback:
            residual = kept.get(name)
            if residual is None:
                jobs.append(Job(name, compensate(g, None), raw=g))
            else:
                at.append((len(jobs), name, g))
                grads32.append(as_fp32(g))
                residuals.append(residual)
                jobs.append(None)
        else:
            # No residual is ever kept from it, and compressors only read a job's tensor:
            # the gradient itself (in fp32) serves, no copy.
            jobs.append(Job(name, as_fp32(g), raw=g))
    if at:
        summed = torch._foreach_add(grads32, residuals)
        for (i, name, g), compensated in zip(at, summed, strict=True):
            # raw: the gradient before error feedback, for controllers that judge the
            # training regime from it (Accordion); a reference, no copy.
            jobs[i] = Job(name, compensated, raw=g)
    return [j for j in jobs if j is not None], dense


def count_dense(engine: EngineBase, numel: int) -> None:
    """Add what a dense fp32 all-reduce of ``numel`` entries would cost to every local
    worker's ``dense_payload_bytes`` / ``dense_wire_bytes``."""
    dense_bytes = 4 * numel
    for w in range(engine.comm.local_workers):
        engine.dense_payload[w] += dense_bytes
        engine.dense_wire[w] += allreduce_wire_bytes(dense_bytes, engine.comm.world_size)


def results(engine: EngineBase, call: Call, jobs: Sequence[Job]) -> dict[str, torch.Tensor]:
    """``name -> average`` in each gradient's dtype, in the engine's parameter order."""
    out = {}
    for job in sorted(jobs, key=lambda j: engine._order[j.name]):
        assert job.averaged is not None, job.name
        dtype = call.named_grads[job.name].dtype
        average = job.averaged
        out[job.name] = average if average.dtype == dtype else average.to(dtype)
    return out


def masked(
    values: dict[str, torch.Tensor], mask: torch.Tensor, fill: torch.Tensor
) -> dict[str, torch.Tensor]:
    """``values`` with every entry ``fill`` where the 0-d bool ``mask`` holds: one ``where``
    over their concatenation (see :func:`~gradzip.ops.flat.pack`) where they share a dtype
    and device, else one per tensor; elementwise the same either way."""
    tensors = list(values.values())
    if len(tensors) < 2 or any(t.dtype != tensors[0].dtype or t.device != tensors[0].device
                               for t in tensors):
        return {n: torch.where(mask, fill, t) for n, t in values.items()}
    kept = torch.where(mask, fill, pack(tensors))
    return dict(zip(values, unpack_like(kept, tensors), strict=True))


def filled(engine: EngineBase, call: Call, value: float) -> dict[str, torch.Tensor]:
    """``name -> tensor full of value`` (a call the non-finite policy handled)."""
    grads = call.named_grads
    return {
        n: torch.full(engine.shapes[n], value, dtype=grads[n].dtype, device=grads[n].device)
        for n in call.names
    }


def end_compressors_step(engine: EngineBase, before: list[object]) -> str | None:
    """Run every compressor's end of step; where a state turns non-finite, its path
    (``before``: the states before the call, whose unchanged leaves need no test)."""
    engine._end_compressors_step()
    where = first_nonfinite(engine._state_tree(engine._states()), "", engine._state_tree(before))
    return None if where is None else where.lstrip(".")
