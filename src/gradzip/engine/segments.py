"""The engine's segment path: a DDP bucket of a whole-message compressor as one flat row.

The ordinary call (:mod:`gradzip.engine.device`) makes a :class:`~gradzip.compressors.base.Job`
per tensor, compensates and tests them as lists, and hands each tensor's average and residual
back as objects of their own: several Python objects and calls per tensor at every stage, for
a compressor that then lays the tensors end to end anyway (Top-k's one selection, Sign's and
QSGD's one message, Rand-k's one draw for the whole call). On a GPU with a short step that
Python is what the hook costs. Here the call keeps one flat row from the bucket to the
residuals:

1. the gradients copied into a row in the order the compressor's plan gives (one
   multi-tensor copy into a buffer made once per bucket layout), compensated by one add of
   the previous call's residual row (with error feedback);
2. one finiteness test of that row, carried in the call's header as on the ordinary path;
3. the compressor's segment form (:meth:`~gradzip.compressors.base.Compressor.reduce_segments`)
   overwrites the row with the residuals and returns the average row;
4. the residuals, views of that row, handed to the non-finite policy (a rollback of the step
   decides each row with one ``where``, see :class:`~gradzip.engine.step.ResidualRow`); the
   compression-error norms of the row before and after; the average masked and copied into
   the bucket.

It applies where the ordinary device path would run (:func:`~gradzip.engine.device.decides_on_device`)
in a real process group of one worker per process, no tensor of the bucket goes to a rule's
compressor, error feedback is on for all its compressed tensors or none, and the compressor's
:meth:`~gradzip.compressors.base.Compressor.segment_plan` has a form for them (Top-k, Rand-k,
QSGD, Sign and the hard threshold with ``lam`` and a ``capacity``, where no tensor takes the
sharded exchange; PowerSGD, whose groups of same-shape matrices lead the row, read from it
in place where they lie at aligned places, its own dense tensors after them; and Accordion with
PowerSGD at both levels, its groups those of both levels, by the tensors' levels). A plan that
depends on the compressor's state (Accordion's levels) is made again when
:meth:`~gradzip.compressors.base.Compressor.segment_key` changes. Tensors the engine sends
dense (``dense_1d``, ``min_numel``) follow the compressed ones in the row and travel first, by
one exact all-reduce, as on the ordinary path.
Everything else takes the ordinary call. The results, state, counters and compression-error
sums are the ordinary device path's, bit for bit (tested against it and against the host
path).

Memory: one gradient-sized row per bucket layout (the gradients in the row's order).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch

from gradzip.comm.header import HeaderRider
from gradzip.compressors.base import SegmentPlan
from gradzip.engine.base import EngineBase
from gradzip.engine.call import Call, code_of, count_dense, out_of_step
from gradzip.engine.deferred import any_nonfinite, changed_tensors, nonfinite_flag
from gradzip.engine.device import finish_on_device
from gradzip.engine.flat import BucketLayout, _runs
from gradzip.engine.policy import NonfinitePolicy
from gradzip.engine.step import ResidualRow, Saved, Step, or_flag
from gradzip.ops.flat import pack, unpack_like

__all__ = ["Segments", "reduce_segments_on_device", "segments_apply"]


@dataclass(eq=False)
class Segments:
    """A bucket layout's segment form, built once per layout, compressor and world size (and
    again when what the plan depends on in the compressor's state changes).

    Attributes:
        key: what it was built for: ``(compressor, world size, what the plan depends on
            in the compressor's state)`` (see :meth:`~gradzip.compressors.base.Compressor.segment_key`).
        plan: the compressor's :meth:`~gradzip.compressors.base.Compressor.segment_plan`,
            or ``None`` where the bucket takes the ordinary call.
        row: ``[1, N]`` fp32, the gradients in the plan's order (filled at every call).
        sources, parts: per run of gradients adjacent both in the bucket and in the row, its
            bucket memory and its slice of ``row`` (the two sides of the multi-tensor copies
            in and out, made once).
        names: the compressed tensors (all but those the engine sends dense), in the
            engine's order.
        compressed: their entries: the row's first part, in the plan's order; the tensors
            the engine sends dense (``dense_1d``, ``min_numel``) follow, in the engine's order.
        likes: the compressed gradients (worker axis first) in the row's order: the shapes of
            the row's views.
        at: for each compressed tensor in the engine's order, its place in the row's order.
        residuals: the views the last call made of its residual row, in the engine's order
            (the steady state's compensation reads that row, ``last``, without looking at
            each view's memory).
        calls: the calls that took this path.
    """

    key: tuple[object, int, object]
    plan: SegmentPlan | None
    row: torch.Tensor | None = None
    sources: list[torch.Tensor] = field(default_factory=list)
    parts: list[torch.Tensor] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    compressed: int = 0
    likes: list[torch.Tensor] = field(default_factory=list)
    at: list[int] = field(default_factory=list)
    residuals: list[torch.Tensor] = field(default_factory=list)
    last: torch.Tensor | None = None
    calls: int = 0


def segments_apply(engine: EngineBase, step: Step, layout: BucketLayout) -> bool:
    """Whether the bucket's call may take the segment path, the device decision aside (the
    caller asks :func:`~gradzip.engine.device.decides_on_device` too, which also requires a
    residual for every compressed tensor); builds the layout's :class:`Segments` on first
    use."""
    comm = engine.comm
    if comm.simulated or comm.local_workers != 1 or engine.rule_compressors:
        return False
    if step.poisoned or not layout.views:
        return False
    compressor, world = engine.compressor, comm.world_size
    # What the plan depends on in the state (a two-level controller's levels): a new plan
    # when it changes, e.g. after a decision (the same on every worker: levels are).
    depends = compressor.segment_key(engine.compressor_state)
    seg = layout.segments
    if (seg is None or seg.key[0] is not compressor or seg.key[1] != world
            or seg.key[2] != depends):
        seg = layout.segments = _build(engine, layout, (compressor, world, depends))
    return seg.plan is not None


def _build(engine: EngineBase, layout: BucketLayout, key: tuple[object, int, object]) -> Segments:
    # The compressed tensors alike: each keeps a residual (error feedback), or none does.
    feedback, keep = engine._feedback, engine.error_feedback
    where = {n: i for i, n in enumerate(layout.names)}
    compressed = [n for n in layout.names if n not in engine.dense_names]
    dense = [where[n] for n in layout.names if n in engine.dense_names]
    if not compressed or any((n in feedback) != keep for n in compressed):
        return Segments(key, None)
    plan = engine.compressor.segment_plan(
        compressed, [layout.sizes[where[n]] for n in compressed], engine.comm.world_size,
        layout.buffer.device, shapes=[layout.grads[where[n]].shape[1:] for n in compressed],
        state=engine.compressor_state)
    if plan is None:
        return Segments(key, None)
    assert sorted(plan.order) == list(range(len(compressed))), "a plan's order is a permutation"
    order = [where[compressed[i]] for i in plan.order]  # bucket tensors, in the row's order
    row = torch.empty(1, layout.numel, dtype=torch.float32, device=layout.buffer.device)
    flat = row.view(-1)
    runs = _runs([layout.views[i] for i in order + dense])
    sources = [src for src, _ in runs]
    parts = [flat[start : start + src.numel()] for src, start in runs]
    at = [0] * len(plan.order)
    for place, i in enumerate(plan.order):
        at[i] = place
    return Segments(key, plan, row, sources, parts, compressed,
                    sum(layout.sizes[i] for i in order), [layout.grads[i] for i in order], at)


def _residual_row(seg: Segments, engine: EngineBase) -> torch.Tensor:
    """``[1, C]``: the residuals of the compressed tensors in the row's order (the last call's
    row where they are still the views it made, else :func:`~gradzip.ops.flat.pack`'s)."""
    kept = engine.residuals
    now = [kept[n] for n in seg.names]
    if seg.last is not None and all(map(operator.is_, now, seg.residuals)):
        return seg.last
    assert seg.plan is not None
    return pack([now[i] for i in seg.plan.order]).view(1, -1)


def reduce_segments_on_device(
    engine: EngineBase, step: Step, policy: NonfinitePolicy, call: Call, layout: BucketLayout,
    before: Saved,
) -> None:
    """The bucket's call as one flat row (see the module docstring), its decisions kept on the
    device, its averages written into the bucket: the same bits, state and counters as the
    ordinary device path.

    Args:
        engine, step, policy: the engine, its step in progress and its non-finite policy.
        call: the bucket's call (:meth:`~gradzip.engine.flat.BucketLayout.call`).
        layout: the bucket's layout (:func:`segments_apply` said yes).
        before: what the policy restores (:meth:`~gradzip.engine.policy.NonfinitePolicy.restore_point`).
    """
    seg = layout.segments
    assert seg is not None and seg.row is not None
    seg.calls += 1
    comm_in, names, count = engine.comm, seg.names, seg.compressed
    device, world = seg.row.device, comm_in.world_size
    # DDP orders a bucket by when its gradients became ready, the engine by its parameter
    # order (the message's layout): one multi-tensor copy puts them in the row's order, one
    # add compensates them all (elementwise the ordinary path's ``grad + residual``).
    torch._foreach_copy_(seg.parts, seg.sources)
    grads, dense = seg.row[:, :count], seg.row[:, count:]
    keep = engine.error_feedback
    previous = _residual_row(seg, engine) if keep else None
    # Without error feedback the compressor reads the gradients themselves (what it leaves
    # in the row is dropped); with it, a new row: the residuals will be views of it (memory
    # made in this call, as the residual contract asks).
    row = grads if previous is None else torch.add(grads, previous)
    bad = nonfinite_flag(row)
    if dense.numel():
        bad = bad | nonfinite_flag(dense)
    rider = HeaderRider(comm_in, code_of(engine, step, call, layout.set_code), bad.reshape(1),
                        lambda: out_of_step(engine, step, call))
    views: list[torch.Tensor] = []
    if keep:
        in_row = unpack_like(row.view(-1), seg.likes)
        views = [in_row[place] for place in seg.at]  # the engine's order, as the ordinary call's
        inputs = torch._foreach_norm(views)  # the compressor's input, before it overwrites it
    out = seg.row.view(-1)
    if dense.numel():
        # The tensors the engine routes dense first, by one exact all-reduce, as the ordinary
        # call sends them before the compressor's (the header rides with them); their
        # averages go where they came from in the row, read by then.
        torch.div(rider.all_reduce_cat([dense]), world, out=out[count:])
    average = engine.compressor.reduce_segments(row, seg.plan, engine.compressor_state, rider,
                                                engine._context(), raw=grads)
    out[:count].copy_(average)
    bad = rider.finish_on_device(device)
    if rider.disagree is not None and world > 1:
        step.desync_dev = or_flag(step.desync_dev, rider.disagree)
    count_dense(engine, layout.numel)
    changed = changed_tensors(engine.compressor_state, before.states[0])
    if changed is None:  # a compressor's bug; the step is abandoned
        raise RuntimeError(
            f"{engine.compressor.spec()} changed its state in a way a device rollback "
            "cannot undo; it must not declare device_decisions"
        )
    flag = bad | any_nonfinite([out, *changed], device)
    mask, fill = policy.keep_on_device(engine, step, names if keep else [], views, before,
                                       flag, one_buffer=True)
    if keep:
        if previous is seg.last:
            # The views this call replaced are the last call's: a rollback of the step decides
            # the row with one ``where`` (see NonfinitePolicy.finish_on_device).
            step.rows.append(ResidualRow(names, seg.residuals, views, previous, row))
        seg.residuals, seg.last = views, row
        engine._errors.add_norms(step.error_sums, names, torch._foreach_norm(views), inputs,
                                 lambda: engine.compressor.tensor_levels(engine.compressor_state))
    if call.finish_step:
        finish_on_device(engine, step, policy, device)
    # Back into the bucket, run by run, from the row buffer (the slices made once serve: no
    # slice per run per call).
    out.masked_fill_(mask, fill)
    torch._foreach_copy_(seg.sources, seg.parts)
