"""The device path: one call whose non-finite decisions stay on the device.

On CUDA a host read of a device value stalls the stream that launches kernels; for
compressors whose collectives' sizes the shapes decide (``Compressor.device_decisions``), the
engine keeps each call's non-finite flag as a 0-d tensor and applies the policy's device form
(:meth:`~gradzip.engine.policy.NonfinitePolicy.on_device`, ``torch.where``; see
:mod:`gradzip.engine.deferred`), bit for bit what the host path gives. ``decide_on="device"``
takes this path on any device (how it is tested on the CPU).
"""

from __future__ import annotations

import torch

from gradzip.comm.base import Collective, allreduce_wire_bytes
from gradzip.comm.header import HEADER_BYTES, HeaderRider
from gradzip.compressors.base import Job, dense_reduce
from gradzip.engine.base import EngineBase
from gradzip.engine.call import Call, count_dense, header_rider, masked, results
from gradzip.engine.deferred import any_nonfinite, changed_tensors, nonfinite_rows_at_once
from gradzip.engine.policy import NonfinitePolicy
from gradzip.engine.step import Saved, Step, or_flag

__all__ = ["decides_on_device", "finish_on_device", "reduce_on_device"]


def decides_on_device(engine: EngineBase, step: Step, call: Call) -> bool:
    """Whether this call keeps its non-finite decisions on the device (no host read).

    Only where every condition holds: ``decide_on`` is ``"device"``, or ``"auto"`` with the
    tensors on CUDA (on the CPU a host read costs nothing, and the host path sends less after
    a non-finite call); the policy is not ``"raise"`` (an exception needs the host to know
    now); the compressor's collectives have shape-determined sizes and tolerate non-finite
    input (``device_decisions``), so ranks may learn of a non-finite gradient after its
    message was sent; nothing needs the header read before the payload (every worker is in
    this process, or the header rides in a payload of guaranteed layout); and every
    compressed tensor has a residual to restore (steady state).
    """
    grads = call.grads
    if engine.decide_on == "host":
        return False
    if not (engine.decide_on == "device" or (grads and grads[0].is_cuda)):
        return False
    if engine.rule_compressors:  # several compressors' states: decided on the host
        return False
    if engine.nonfinite == "raise" or not engine.compressor.device_decisions or not grads:
        return False
    if not (call.same_layout or engine.comm.simulated or engine.comm.world_size == 1):
        return False
    if engine.compressor.host_call(engine.compressor_state, engine._context(),
                                   finish_step=call.finish_step):
        return False  # a controller's decision changes plain state: read on the host
    if step.poisoned:  # decided on the host already: the host path goes on
        return False
    if not engine.error_feedback:
        return True
    target = engine.residuals if engine.nonfinite == "zero" else step.started_at().residuals
    return all(n in target for n in call.names if n not in engine.dense_names)


def reduce_on_device(
    engine: EngineBase, step: Step, policy: NonfinitePolicy, call: Call,
    jobs: list[Job], dense: list[Job], before: Saved,
) -> dict[str, torch.Tensor]:
    """One call whose non-finite decisions stay on the device (:func:`decides_on_device`).

    The same results, state and counters as the host path, bit for bit. Differences: no
    warning is logged (``stats["skipped_steps"]`` still counts), and a call made after a
    non-finite one sends its payload (the host path sends only the header), so byte counts
    differ in such steps. Ranks out of step (only possible in a real group, with the header
    riding) raise at the end of the step, on every rank, with the step abandoned.

    Args: as :func:`~gradzip.engine.host.reduce_on_host`.
    """
    comm_in: Collective = engine.comm
    workers, world = comm_in.local_workers, comm_in.world_size
    tensors = [j.tensor for j in jobs + dense]
    device = tensors[0].device
    bad_rows = nonfinite_rows_at_once(tensors, workers)
    comm = comm_in
    rider: HeaderRider | None = None
    if call.same_layout:
        rider = header_rider(engine, step, call, bad_rows)
        comm = rider
    else:
        # Every worker is in this process (``decides_on_device``), so they make the same
        # call by construction and their non-finite agreement is the local "any". The
        # header is counted as the real group would send it, so byte counts match.
        wire = allreduce_wire_bytes(HEADER_BYTES, world)
        comm_in.meter.add([HEADER_BYTES] * workers, [wire] * workers)
    dense_reduce(dense, comm)
    if jobs:
        engine.compressor.reduce(jobs, engine.compressor_state, comm, engine._context())
    if rider is not None:
        bad = rider.finish_on_device(device)
        if rider.disagree is not None and not (comm_in.simulated or world == 1):
            step.desync_dev = or_flag(step.desync_dev, rider.disagree)
    else:
        bad = bad_rows.any()
    count_dense(engine, sum(j.numel for j in jobs + dense))
    averaged = [job.averaged for job in jobs + dense]
    changed = changed_tensors(engine.compressor_state, before.states[0])
    if changed is None:  # a compressor's bug; the step is abandoned
        raise RuntimeError(
            f"{engine.compressor.spec()} changed its state in a way a device rollback "
            "cannot undo; it must not declare device_decisions"
        )
    flag = bad | any_nonfinite([a for a in averaged if a is not None] + changed, device)
    mask, fill = policy.on_device(engine, step, jobs, before, flag)
    engine._measure(jobs)  # before end_step: a controller's levels are this call's
    if call.finish_step:
        finish_on_device(engine, step, policy, device)
    out = results(engine, call, jobs + dense)
    if call.defer_mask:
        call.mask = (mask, fill)  # the caller masks (a DDP bucket: its buffer in one op)
        return out
    # One 0-d fill for the call (a Python number would make one per ``where``).
    return masked(out, mask, torch.full((), fill, dtype=torch.float32, device=device))


def finish_on_device(
    engine: EngineBase, step: Step, policy: NonfinitePolicy, device: torch.device
) -> None:
    """The end of a step whose decisions are on the device: the compressor's end of step,
    the policy's device form, the skipped-step count; then the one host read of a step whose
    header rode in a real group (ranks out of step)."""
    start = engine.compressor_state
    engine.compressor.end_step(engine.compressor_state, engine._context())
    changed = changed_tensors(engine.compressor_state, start)
    if changed is None:
        raise RuntimeError(
            f"{engine.compressor.spec()} changed its state at the end of a step in a way a "
            "device rollback cannot undo; it must not declare device_decisions"
        )
    # No changed tensor (a stateless compressor): nothing to test, no op.
    end_bad = any_nonfinite(changed, device) if changed else None
    handled = policy.finish_on_device(engine, step, start, end_bad, device)
    if not step.handled:
        # A call of this step decided on the host already handled it: the step counts once,
        # when it commits (see Engine._commit_call), however many calls were non-finite.
        engine._skips.add_on_device(handled)
    step.poison_dev = step.handled_dev = None
    if step.desync_dev is not None:
        # Why only now: with the header riding in a payload of guaranteed layout, and
        # collectives whose sizes the shapes decide, ranks out of step exchange messages of
        # equal sizes (nothing aborts); reading once per step instead of once per call keeps
        # the host from waiting on every bucket. Every rank reads the same sums.
        desync, step.desync_dev = bool(step.desync_dev), None
        if desync:
            raise RuntimeError(
                f"ranks are out of step: at least one call of step {engine.step} on rank "
                f"{engine.comm.first_rank} differed from another rank's (another step or "
                f"call of the step); every rank must make the same sequence of reduce "
                f"calls. Found at the step's end; the step was abandoned."
            )
    if not step.handled:  # a handled step counts zero (the host's: dropped at its commit)
        engine._errors.commit(step.error_sums, dropped=handled)
    step.error_sums = [None, None, None]

