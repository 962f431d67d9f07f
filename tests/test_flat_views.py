"""Flat buffers made and viewed in one call (gradzip.ops.flat) and the device rollback that
writes into the residuals it replaces (gradzip.engine.deferred.where_many): the same values
and views as the per-tensor forms they replace."""

from __future__ import annotations

import pytest
import torch

from gradzip.compressors.base import Job, give_averages, job_rows
from gradzip.engine.deferred import where_many
from gradzip.ops.flat import cat_flat, cat_rows, pack, unpack, unpack_like

SHAPES = [torch.Size((1, 4, 3)), torch.Size((1, 5)), torch.Size((1, 2, 2, 2)), torch.Size((1, 1))]


def _tensors(shapes=SHAPES, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def _same_views(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(x.shape == y.shape and x.stride() == y.stride() and x.data_ptr() == y.data_ptr()
               for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("count", [1, 2, 4])
def test_cat_flat_and_cat_rows_equal_torch_cat_and_copy(count: int) -> None:
    tensors = _tensors()[:count]
    flat = cat_flat(tensors)
    assert torch.equal(flat, torch.cat([t.reshape(-1) for t in tensors]))
    assert all(flat.data_ptr() != t.data_ptr() for t in tensors)  # a copy, also of one tensor
    rows = cat_rows(tensors, 1)
    assert rows.shape == (1, flat.numel()) and torch.equal(rows[0], flat)
    flat[0] = 1e9
    assert tensors[0].reshape(-1)[0] != 1e9


def test_cat_rows_with_several_rows_is_the_column_concatenation() -> None:
    tensors = [torch.randn(3, 4), torch.randn(3, 2, 2)]
    assert torch.equal(cat_rows(tensors, 3),
                       torch.cat([t.reshape(3, -1) for t in tensors], dim=1))


def test_cat_flat_promotes_like_torch_cat() -> None:
    tensors = [torch.ones(2), torch.ones(3, dtype=torch.float64)]
    assert cat_flat(tensors).dtype == torch.cat([t.reshape(-1) for t in tensors]).dtype


def test_unpack_and_unpack_like_give_the_views_of_split_and_view() -> None:
    shapes = [torch.Size((4, 3)), torch.Size((5,)), torch.Size((2, 2, 2)), torch.Size(())]
    flat = torch.arange(float(sum(s.numel() for s in shapes)))
    expected = [part.view(s) for part, s in zip(flat.split([s.numel() for s in shapes]), shapes,
                                               strict=True)]
    assert _same_views(unpack(flat, shapes), expected)
    assert _same_views(unpack(flat, [tuple(s) for s in shapes]), expected)  # any sequence
    likes = [torch.empty(s) for s in shapes]
    assert _same_views(unpack_like(flat, likes), expected)


def test_unpack_keeps_the_shape_of_an_empty_tensor() -> None:
    shapes = [torch.Size((2,)), torch.Size((0, 3)), torch.Size((1, 2))]
    views = unpack(torch.arange(4.0), shapes)
    assert [v.shape for v in views] == shapes
    assert torch.equal(views[2], torch.tensor([[2.0, 3.0]]))


def test_unpack_refuses_a_size_mismatch() -> None:
    with pytest.raises(AssertionError):
        unpack(torch.zeros(5), [torch.Size((2, 2))])


def test_job_rows_and_give_averages_equal_the_per_job_forms() -> None:
    tensors = _tensors()
    jobs = [Job(f"t{i}", t) for i, t in enumerate(tensors)]
    rows = cat_rows(tensors, 1)
    assert _same_views(job_rows(jobs, rows),
                       [p.reshape(j.tensor.shape) for j, p in
                        zip(jobs, rows.split([j.numel for j in jobs], dim=1), strict=True)])
    many = torch.randn(3, sum(j.numel for j in jobs))  # several rows: copies of the blocks
    blocks = job_rows([Job(j.name, torch.zeros(3, *j.shape)) for j in jobs], many)
    start = 0
    for job, block in zip(jobs, blocks, strict=True):
        assert torch.equal(block.reshape(3, -1), many[:, start:start + job.numel])
        start += job.numel
    total = torch.randn(sum(j.numel for j in jobs))
    give_averages(jobs, total)
    assert torch.equal(torch.cat([j.averaged.reshape(-1) for j in jobs]), total)
    assert [j.averaged.shape for j in jobs] == [j.shape for j in jobs]
    strided = torch.randn(2 * total.numel())[::2]  # not contiguous: reshaped copies
    give_averages(jobs, strided)
    assert torch.equal(torch.cat([j.averaged.reshape(-1) for j in jobs]), strided)


@pytest.mark.parametrize("flag", [True, False])
def test_where_many_in_place_writes_into_a_tiled_buffer(flag: bool) -> None:
    before = _tensors(seed=1)
    after = unpack(cat_flat(_tensors(seed=2)), SHAPES)  # one buffer, tiled
    values = [t.clone() for t in after]
    chosen = where_many(torch.tensor(flag), before, after, in_place=True)
    assert all(c is a for c, a in zip(chosen, after, strict=True))
    for c, b, v in zip(chosen, before, values, strict=True):
        assert torch.equal(c, b if flag else v)
    out_of_place = where_many(torch.tensor(flag), before, values)
    assert all(torch.equal(c, o) for c, o in zip(chosen, out_of_place, strict=True))


def test_where_many_in_place_leaves_non_tiling_tensors_and_shared_memory_alone() -> None:
    before = [torch.randn(3, 4)]
    strided = torch.randn(4, 3).t()  # not contiguous: a new tensor, the old one unchanged
    kept = strided.clone()
    (chosen,) = where_many(torch.tensor(True), before, [strided], in_place=True)
    assert chosen is not strided and torch.equal(strided, kept)
    assert torch.equal(chosen, before[0])
    # New values in the old values' own buffer (other view objects): never written into.
    old = unpack(cat_flat(_tensors(seed=3)), SHAPES)
    whole = pack(old)
    aliased = unpack(whole, SHAPES)
    snapshot = whole.clone()
    chosen = where_many(torch.tensor(True), old, aliased, in_place=True)
    assert all(c is not a for c, a in zip(chosen, aliased, strict=True))
    assert all(c.data_ptr() != whole.data_ptr() for c in chosen[:1])
    assert torch.equal(whole, snapshot)
    assert all(torch.equal(c, o) for c, o in zip(chosen, old, strict=True))


@pytest.mark.parametrize("flag", [True, False])
def test_where_many_finds_a_buffer_whose_views_come_in_another_order(flag: bool) -> None:
    # Views of one row listed in another order than their memory's (the segment path's
    # residuals, listed in the engine's order): still one buffer, written in place.
    order = [2, 0, 3, 1]
    tensors = _tensors(seed=2)
    in_memory = unpack(cat_flat([tensors[i] for i in order]), [SHAPES[i] for i in order])
    after = [in_memory[order.index(i)] for i in range(len(SHAPES))]
    before_row = unpack(cat_flat([_tensors(seed=1)[i] for i in order]), [SHAPES[i] for i in order])
    before = [before_row[order.index(i)] for i in range(len(SHAPES))]
    expected = [t.clone() for t in (before if flag else after)]
    chosen = where_many(torch.tensor(flag), before, after, in_place=True)
    assert all(c is a for c, a in zip(chosen, after, strict=True))
    assert all(torch.equal(c, e) for c, e in zip(chosen, expected, strict=True))
