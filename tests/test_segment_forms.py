"""Compressors' segment forms (:meth:`~gradzip.compressors.base.Compressor.reduce_segments`)
against their ordinary ``reduce``, in one process: the same averages, residuals and bytes, bit
for bit, for every worker of a simulated group; and where a compressor has no such form."""

from __future__ import annotations

import contextlib

import pytest
import torch

from gradzip.comm.simulated import SimulatedGroup
from gradzip.compressors.base import Job, SegmentPlan, StepContext, leftovers
from gradzip.compressors.topk import TopK
from gradzip.ops.branches import device_forms
from gradzip.ops.lowrank import ALIGN_BYTES, stack_region
from gradzip.ops.segmented import MAX_ENTRIES
from gradzip.spec import compressor_from_spec

SHAPES = [(6, 5), (4,), (1,), (3, 3, 2), (2,), (40,)]


def _same_tree(a: object, b: object) -> bool:
    """Whether two states hold the same values, tensors bit for bit."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_tree(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


def _names(sizes: list[int]) -> list[str]:
    return [f"t{i}" for i in range(len(sizes))]


def _tensors(workers: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(workers, *shape, generator=g) for shape in SHAPES]
    out[0][:, 0, :2] = 0.5  # ties within a tensor
    return out


#: Compressors with a segment form, with and without tensors sent dense.
SEGMENT_SPECS = ("topk:ratio=0.05,exchange=allgather", "topk:ratio=0.3", "topk:ratio=1.0",
                 "sign:exchange=allgather", "sign", "randk:ratio=0.1", "randk:ratio=0.5",
                 "qsgd:exchange=allgather", "qsgd:levels=4,bucket_size=7,exchange=allgather",
                 "threshold:lam=0.5,capacity=0.2", "threshold:lam=0.5,capacity=0.2,padded=false",
                 "powersgd:rank=1", "powersgd:rank=2,power_iterations=2,min_compression_rate=1",
                 "powersgd:rank=1,warm_start=false", "powersgd:rank=4,min_compression_rate=50")


def _both_forms(compressor: object, plan: SegmentPlan, shapes: list[torch.Size],
                tensors: list[torch.Tensor], workers: int) -> torch.Tensor:
    """Reduce ``tensors`` by ``compressor.reduce`` and by its segment form on a row laid out
    in ``plan``'s order; check the averages, residuals, state and bytes alike bit for bit.
    Returns the row (the residuals after the segment form)."""
    ctx = StepContext(step=0, ranks=tuple(range(workers)), world_size=workers)
    named = {f"t{i}": s for i, s in enumerate(shapes)}
    jobs = [Job(f"t{i}", t.clone()) for i, t in enumerate(tensors)]
    ordinary = SimulatedGroup(workers)
    ordinary_state = compressor.init_group_state(named, workers, workers)  # type: ignore[attr-defined]
    compressor.reduce(jobs, ordinary_state, ordinary, ctx)  # type: ignore[attr-defined]
    rests = leftovers(jobs)
    row = torch.cat([tensors[i].reshape(workers, -1) for i in plan.order], dim=1)
    segmented = SimulatedGroup(workers)
    segmented_state = compressor.init_group_state(named, workers, workers)  # type: ignore[attr-defined]
    average = compressor.reduce_segments(  # type: ignore[attr-defined]
        row, plan, segmented_state, segmented, ctx)
    assert _same_tree(segmented_state, ordinary_state)
    start = 0
    for i in plan.order:
        end = start + shapes[i].numel()
        assert torch.equal(average[start:end].reshape(shapes[i]), jobs[i].averaged), i
        assert torch.equal(row[:, start:end].reshape(workers, *shapes[i]), rests[i]), i
        start = end
    assert segmented.meter.payload == ordinary.meter.payload
    assert segmented.meter.wire == ordinary.meter.wire
    return row


@pytest.mark.parametrize("forms", ["cpu", "device"])
@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("spec", SEGMENT_SPECS)
def test_segments_equal_reduce(spec: str, workers: int, forms: str) -> None:
    compressor = compressor_from_spec(spec)
    shapes = [torch.Size(s) for s in SHAPES]
    sizes = [s.numel() for s in shapes]
    plan = compressor.segment_plan(_names(sizes), sizes, workers, torch.device("cpu"),
                                   shapes=shapes)
    assert isinstance(plan, SegmentPlan)
    assert sorted(plan.order) == list(range(len(sizes)))
    with device_forms() if forms == "device" else contextlib.nullcontext():
        _both_forms(compressor, plan, shapes, _tensors(workers, seed=len(spec) + workers),
                    workers)


def test_dense_tensors_go_last_in_the_engine_order() -> None:
    assert compressor_from_spec("topk:ratio=0.3").segment_plan(
        _names([30, 4, 1, 18, 2, 40]), [30, 4, 1, 18, 2, 40], 3, torch.device("cpu")).order == (0, 1, 3, 5, 2, 4)
    assert compressor_from_spec("topk:ratio=1.0").segment_plan(
        _names([30, 4]), [30, 4], 3, torch.device("cpu")).order == (0, 1)  # all dense


def test_topk_puts_dense_tensors_last_in_the_engine_order() -> None:
    topk = TopK(ratio=0.2)  # at two workers a 1-entry tensor is cheaper sent dense
    sizes = [30, 1, 50, 1]
    plan = topk.segment_plan(_names(sizes), sizes, 2, torch.device("cpu"))
    assert plan is not None and plan.order == (0, 2, 1, 3)


def test_topk_has_no_segment_form_where_a_tensor_is_sharded_or_positions_overflow() -> None:
    assert TopK(ratio=0.01, exchange="sharded").segment_plan(["a"], [1000], 4, torch.device("cpu")) is None
    assert TopK(ratio=0.01).segment_plan(["a", "b"], [MAX_ENTRIES, 10], 2,
                                         torch.device("cpu")) is None
    assert TopK(ratio=0.01).segment_plan([], [], 2, torch.device("cpu")) is None


@pytest.mark.parametrize("spec", ["none", "fp16", "powersgd:rank=2", "threshold:lam=0.01",
                                  "threshold:budget=0.01,capacity=0.1"])
def test_other_compressors_and_forms_have_no_segment_form(spec: str) -> None:
    # The threshold's exchanged sizes and its budget read values on the host: no segment form.
    compressor = compressor_from_spec(spec)
    assert compressor.segment_plan(["a", "b"], [10, 20], 2, torch.device("cpu")) is None


def test_powersgd_needs_shapes_for_a_segment_form() -> None:
    compressor = compressor_from_spec("powersgd:rank=2")
    assert compressor.segment_plan(["a", "b"], [64, 8], 2, torch.device("cpu")) is None
    every_dense = compressor.segment_plan(["a", "b"], [64, 8], 2, torch.device("cpu"),
                                          shapes=[torch.Size([64]), torch.Size([8])])
    assert every_dense is not None and every_dense.order == (0, 1)
    plan = compressor.segment_plan(["a", "b", "c"], [8, 64, 64], 2, torch.device("cpu"),
                                   shapes=[torch.Size([8]), torch.Size([8, 8]),
                                           torch.Size([8, 2, 4])])
    assert plan is not None and plan.order == (1, 2, 0)  # the 8 x 8 group, then the dense one
    # Groups whose matrices are not whole multiples of 64 bytes go after those that are (in
    # the row only: the message keeps the groups' sorted order).
    odd = compressor_from_spec("powersgd:rank=1,min_compression_rate=1").segment_plan(
        ["a", "b", "c"], [15, 4, 32], 2, torch.device("cpu"),
        shapes=[torch.Size([3, 5]), torch.Size([4]), torch.Size([4, 8])])
    assert odd is not None and odd.order == (2, 0, 1)


@pytest.mark.parametrize("spec", ["none", "fp16"])
def test_the_default_segment_form_refuses(spec: str) -> None:
    with pytest.raises(NotImplementedError, match="no segment form"):
        compressor_from_spec(spec).reduce_segments(
            torch.zeros(1, 30), SegmentPlan((0, 1), None), {}, SimulatedGroup(2),
            StepContext(0, (0, 1), 2))


@pytest.mark.parametrize("spec", ["qsgd", "sign", "topk:ratio=0.01"])
def test_a_tensor_in_the_sharded_exchange_leaves_no_segment_form(spec: str) -> None:
    compressor = compressor_from_spec(spec)
    pinned = compressor_from_spec(spec + ("," if ":" in spec else ":") + "exchange=sharded")
    sizes = [4000, 3000]
    assert compressor.segment_plan(_names(sizes), sizes, 1, torch.device("cpu")) is not None
    assert pinned.segment_plan(_names(sizes), sizes, 8, torch.device("cpu")) is None


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("spec", ["powersgd:rank=1",
                                  "powersgd:rank=2,power_iterations=2,min_compression_rate=1"])
def test_powersgd_reads_aligned_matrices_in_the_row_and_writes_residuals_over_them(
    spec: str, workers: int
) -> None:
    # Every matrix 64-byte aligned in the row and no tensor sent dense: the groups' matrices
    # are views of the row (no copy), and their residuals are written over them.
    shapes = [torch.Size(s) for s in [(4, 8), (8, 4, 2), (4, 8), (16, 4)]]
    sizes = [s.numel() for s in shapes]
    compressor = compressor_from_spec(spec)
    plan = compressor.segment_plan(_names(sizes), sizes, workers, torch.device("cpu"),
                                   shapes=shapes)
    assert plan is not None and plan.order == (0, 2, 1, 3)  # groups (4, 8), (8, 8), (16, 4)
    g = torch.Generator().manual_seed(workers)
    tensors = [torch.randn(workers, *s, generator=g) for s in shapes]
    row = torch.cat([tensors[i].reshape(workers, -1) for i in plan.order], dim=1)
    assert row.data_ptr() % ALIGN_BYTES == 0  # as _both_forms lays it out
    assert stack_region(row[:, :64], 2, 4, 8).data_ptr() == row.data_ptr()  # read in place
    _both_forms(compressor, plan, shapes, tensors, workers)


def test_stack_region_copies_matrices_that_are_not_aligned() -> None:
    row = torch.randn(1, 65)
    region = stack_region(row[:, 1:], 2, 4, 8)  # 4 bytes past an aligned start
    assert region.data_ptr() != row.data_ptr() + 4 and region.data_ptr() % ALIGN_BYTES == 0
    assert torch.equal(region.reshape(1, -1), row[:, 1:])
