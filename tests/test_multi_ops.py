"""Multi-tensor copies and subtractions (gradzip.ops.multi) and the factorisation of many
batches at once (gradzip.ops.lowrank.orthonormal_many)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from gradzip.ops.lowrank import aligned_matrices, orthonormal, orthonormal_many
from gradzip.ops.multi import copy_many, sub_many_


def _op_names(fn) -> Counter[str]:  # noqa: ANN001
    """The top-level ``aten::`` ops ``fn`` runs (their children not counted)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    names: Counter[str] = Counter()
    for ev in prof.events():
        parent = ev.cpu_parent
        if ev.name.startswith("aten::") and (parent is None or not parent.name.startswith("aten::")):
            names[ev.name] += 1
    return names


def _pairs() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Three pairs CUDA's multi-tensor kernel takes (same sizes and strides, dense) and two
    it does not (a transposed destination; a padded, hence not dense, one)."""
    g = torch.Generator().manual_seed(0)
    dsts = [torch.zeros(3, 4), torch.zeros(5), torch.zeros(2, 2, 8),
            torch.zeros(4, 3).t(), aligned_matrices((), [(2, 3, 3)], dtype=torch.float32,
                                                    device="cpu")[0]]
    srcs = [torch.randn(d.shape, generator=g) for d in dsts]
    return dsts, srcs


def test_copy_many_copies_every_pair_and_launches_once_for_those_cuda_takes_together() -> None:
    dsts, srcs = _pairs()
    ops = _op_names(lambda: copy_many(dsts, srcs))
    for d, s in zip(dsts, srcs, strict=True):
        assert torch.equal(d, s)
    assert ops["aten::_foreach_copy_"] == 1
    assert ops["aten::copy_"] == 2  # the transposed and the padded destinations, one each


def test_sub_many_subtracts_bit_for_bit_as_one_subtraction_per_pair() -> None:
    dsts, others = _pairs()
    g = torch.Generator().manual_seed(1)
    for d in dsts:
        d.copy_(torch.randn(d.shape, generator=g) * 1e3)
    expected = [torch.sub(d, o) for d, o in zip(dsts, others, strict=True)]
    ops = _op_names(lambda: sub_many_(dsts, others))
    for d, e in zip(dsts, expected, strict=True):
        assert torch.equal(d, e)
    assert ops["aten::_foreach_sub_"] == 1
    assert ops["aten::sub_"] == 2


def test_a_single_pair_takes_the_plain_op_and_lengths_must_match() -> None:
    a, b = torch.zeros(4), torch.ones(4)
    ops = _op_names(lambda: copy_many([a], [b]))
    assert torch.equal(a, b) and ops["aten::copy_"] == 1 and not ops["aten::_foreach_copy_"]
    copy_many([], [])  # nothing to do
    with pytest.raises(ValueError, match="`srcs` must have the same length, got 1 and 0"):
        copy_many([a], [])
    with pytest.raises(ValueError, match="`others` must have the same length"):
        sub_many_([a, a], [b])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_orthonormal_many_is_each_batch_alone_bit_for_bit(dtype: torch.dtype) -> None:
    """Batches padded and not (``n`` a multiple of the 64-byte quantum or not), rank 1 and
    higher, with and without a batch axis, and an empty one, in one call."""
    g = torch.Generator().manual_seed(2)
    shapes = [(3, 4, 16), (2, 1, 7), (5, 2, 33), (1, 16), (0, 2, 8), (2, 4, 9)]
    pts = [torch.randn(s, generator=g, dtype=dtype) for s in shapes]
    many = orthonormal_many(pts)
    assert len(many) == len(pts)
    for pt, got in zip(pts, many, strict=True):
        alone = orthonormal(pt.clone())
        assert got.shape == (*pt.shape[:-2], pt.shape[-1], pt.shape[-2])
        assert torch.equal(got, alone)
    # A zero matrix gives unit vectors, as alone.
    zero = orthonormal_many([torch.zeros(2, 1, 5, dtype=dtype), torch.zeros(1, 3, 20, dtype=dtype)])
    assert torch.equal(zero[0], orthonormal(torch.zeros(2, 1, 5, dtype=dtype)))
