"""The host path: one call whose non-finite decision is read on the host.

The header (apart, or riding in the payload), the payload's exchange through the
compressors, the finiteness test of the average and the state, the residuals kept, and the
policy's host form. The default path everywhere but on CUDA with device-friendly
compressors (see :mod:`gradzip.engine.device`), and the reference the other paths are
tested against (``decide_on="host"``).
"""

from __future__ import annotations

import torch

from gradzip.compressors.base import Job, dense_reduce, leftovers
from gradzip.engine.base import EngineBase
from gradzip.engine.call import (
    Call,
    count_dense,
    end_compressors_step,
    exchange_header,
    header_rider,
    results,
)
from gradzip.engine.deferred import finite_rows_at_once
from gradzip.engine.policy import NonfinitePolicy
from gradzip.engine.step import Saved, Step
from gradzip.statecheck import first_nonfinite

__all__ = ["reduce_on_host"]


def _zero_rows(tensor: torch.Tensor, bad: list[bool]) -> torch.Tensor:
    """A copy of ``tensor[L, ...]`` with the rows of the workers marked bad set to zero."""
    out = tensor.clone()
    for w, is_bad in enumerate(bad):
        if is_bad:
            out[w] = 0.0
    return out


def reduce_on_host(
    engine: EngineBase, step: Step, policy: NonfinitePolicy, call: Call,
    jobs: list[Job], dense: list[Job], before: Saved,
) -> dict[str, torch.Tensor]:
    """One call decided on the host.

    Args:
        engine, step, policy: the engine, its step in progress and its non-finite policy.
        call: the call.
        jobs, dense: its compressed and dense jobs (:func:`~gradzip.engine.call.build_jobs`).
        before: what the policy restores (:meth:`NonfinitePolicy.restore_point`).

    Returns:
        ``name -> averaged gradient`` (or the policy's NaN or zeros).
    """
    nonfinite = "a gradient holds NaN or Inf"
    # The compensated gradient, not only the incoming one: a finite gradient plus a finite
    # residual can overflow, and that must not reach the compressor or the state.
    bad = [not ok for ok in finite_rows_at_once([j.tensor for j in jobs + dense],
                                                engine.comm.local_workers).tolist()]
    if call.same_layout:
        # The agreement rides in the payload, so it is known only after the compressor has
        # started sending: a worker whose gradient is non-finite sends zeros instead
        # (compressors are handed finite tensors only; the result is discarded by the
        # policy on every worker alike, and zeros keep every message's size).
        if any(bad):
            jobs = [Job(j.name, _zero_rows(j.tensor, bad)) for j in jobs]
            dense = [Job(j.name, _zero_rows(j.tensor, bad)) for j in dense]
        rider = header_rider(engine, step, call, bad)
        dense_reduce(dense, rider)
        engine._reduce_routed(jobs, rider)
        if rider.finish():
            return policy.on_host(engine, step, call, before, nonfinite)
    else:
        if exchange_header(engine, step, call, bad):
            return policy.on_host(engine, step, call, before, nonfinite)
        dense_reduce(dense, engine.comm)
        engine._reduce_routed(jobs, engine.comm)
    count_dense(engine, sum(j.numel for j in jobs + dense))
    averaged = {job.name: job.averaged for job in jobs + dense}
    assert all(a is not None for a in averaged.values()), call.names
    # The average and the compressor's state are identical on every worker (both come from
    # aggregated quantities), so testing them locally takes the same decision everywhere.
    # Residuals are per worker: compressors guarantee they are finite whenever the
    # compensated gradient and the average are (see ``Compressor.reduce``).
    # The averages and the state's changed tensors in one pass (one host read); only where
    # the test fails is the path looked up, in the order of the tree (the averages first).
    tree = {"average": averaged, **engine._state_tree(engine._states())}
    overflow = first_nonfinite(tree, "", engine._state_tree(before.states))
    if overflow is None:
        fed = [job for job in jobs if job.name in engine._feedback]
        for job, rest in zip(fed, leftovers(fed), strict=True):
            engine.residuals[job.name] = rest
        engine._measure(jobs)  # before end_step: a controller's levels are this call's
        if call.finish_step:
            overflow = end_compressors_step(engine, before.states)
    if overflow is not None:
        return policy.on_host(
            engine, step, call, before, f"compression overflowed in {overflow.lstrip('.')}"
        )
    return results(engine, call, jobs + dense)
