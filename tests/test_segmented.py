"""Whole-message selection (gradzip.ops.segmented) and the sparsifiers built on it."""

from __future__ import annotations

import pytest
import torch

import gradzip
from gradzip.compressors.base import Job, StepContext
from gradzip.ops.branches import device_forms
from gradzip.ops.segmented import (
    MAX_ENTRIES,
    in_segments,
    pieces,
    segment_keys,
    segment_layout,
    segmented_topk,
    strided_random,
)


def _rows(sizes: list[int], rows: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, sum(sizes), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("sizes", [[7], [5, 1, 9], [100, 3, 64, 64, 250]])
def test_segmented_topk_is_each_segments_topk(sizes: list[int]) -> None:
    picks = [max(1, n // 4) for n in sizes]
    flat = _rows(sizes)
    got = segmented_topk(flat, segment_layout(sizes, picks, "cpu"))
    start = col = 0
    for n, k in zip(sizes, picks, strict=True):
        want = torch.topk(flat[:, start : start + n].abs(), k, dim=1).indices + start
        assert torch.equal(got[:, col : col + k], want)  # no ties: the same order too
        start, col = start + n, col + k


def test_ties_go_to_the_lower_position_and_nan_ranks_first() -> None:
    flat = torch.tensor([[1.0, -2.0, 2.0, 0.0, -2.0, float("nan"), 3.0, 3.0, -3.0]])
    layout = segment_layout([5, 4], [2, 3], "cpu")
    got = segmented_topk(flat, layout).tolist()
    assert got == [[1, 2, 5, 6, 7]]


def test_a_segments_choice_does_not_depend_on_its_neighbours() -> None:
    a, b = _rows([300], seed=1), _rows([50], seed=2)
    alone = segmented_topk(a, segment_layout([300], [7], "cpu"))
    together = segmented_topk(torch.cat([b, a], dim=1), segment_layout([50, 300], [4, 7], "cpu"))
    assert torch.equal(together[:, 4:] - 50, alone)


def test_in_segments_finds_a_position_outside_its_segment() -> None:
    layout = segment_layout([4, 6], [2, 2], "cpu")
    assert bool(in_segments(torch.tensor([[0, 3, 4, 9]], dtype=torch.int32), layout))
    for bad in ([0, 4, 4, 9], [0, 3, 3, 9], [-1, 3, 4, 9], [0, 3, 4, 10]):
        assert not bool(in_segments(torch.tensor([bad], dtype=torch.int32), layout)), bad


def test_layouts_are_validated() -> None:
    with pytest.raises(ValueError, match="non-empty and of equal length"):
        segment_layout([], [], "cpu")
    with pytest.raises(ValueError, match=r"in \[1, its segment's size\], got 5 for size 4"):
        segment_layout([4], [5], "cpu")
    with pytest.raises(ValueError, match=f"at most {MAX_ENTRIES}"):
        segment_layout([MAX_ENTRIES, 1], [1, 1], "cpu")
    with pytest.raises(ValueError, match=r"`flat` must be float32 \[L, 10\]"):
        segmented_topk(torch.zeros(1, 9), segment_layout([10], [1], "cpu"))
    with pytest.raises(ValueError, match=r"`keys` must be int64 of shape \(2,\)"):
        strided_random(torch.zeros(3, dtype=torch.int64), segment_layout([5, 5], [1, 1], "cpu"))


@pytest.mark.parametrize(("sizes", "picks"), [([10], [3]), ([1000, 7, 64], [10, 7, 1]), ([5], [5])])
def test_strided_draws_are_distinct_one_per_stride_and_keyed(sizes: list[int], picks: list[int]) -> None:
    layout = segment_layout(sizes, picks, "cpu")
    first = strided_random(segment_keys(range(len(sizes)), "cpu"), layout)
    assert torch.equal(first, strided_random(segment_keys(range(len(sizes)), "cpu"), layout))
    starts, col = layout.starts(), 0
    for i, (n, k) in enumerate(zip(sizes, picks, strict=True)):
        got = first[col : col + k] - starts[i]
        bounds = [j * n // k for j in range(k + 1)]
        assert all(bounds[j] <= int(got[j]) < bounds[j + 1] for j in range(k))
        col += k
    draws = {tuple(strided_random(segment_keys([key] * len(sizes), "cpu"), layout).tolist())
             for key in range(20)}
    assert len(draws) == 1 if sizes == picks else len(draws) > 10  # keyed (taking all: one)


def test_a_segments_draw_does_not_depend_on_its_neighbours() -> None:
    alone = strided_random(segment_keys([42], "cpu"), segment_layout([500], [9], "cpu"))
    together = strided_random(segment_keys([3, 42], "cpu"), segment_layout([70, 500], [2, 9], "cpu"))
    assert torch.equal(together[2:] - 70, alone)


def test_strided_draws_cover_a_stride_evenly() -> None:
    layout = segment_layout([12], [2], "cpu")  # strides of 6 entries
    counts = torch.zeros(12)
    for key in range(6000):
        counts[strided_random(segment_keys([key], "cpu"), layout)] += 1
    # 1000 expected per entry; four standard deviations is about 120.
    assert counts.min() > 850 and counts.max() < 1150, counts


SHAPES = {"a": torch.Size([40, 30]), "b": torch.Size([64]), "c": torch.Size([16, 3, 3, 3]),
          "d": torch.Size([7])}


def _reduce(spec: str, names: list[list[str]], grads: dict[str, torch.Tensor], step: int = 3) -> dict:
    comp = gradzip.compressor_from_spec(spec)
    state = comp.init_state(SHAPES)
    out = {}
    for part in names:
        jobs = [Job(n, grads[n].clone()) for n in part]
        comp.reduce(jobs, state, gradzip.SimulatedGroup(3), StepContext(step, (0, 1, 2), 3))
        out.update({j.name: (j.averaged, j.leftover()) for j in jobs})
    return out


@pytest.mark.parametrize("spec", ["topk:ratio=0.05,exchange=allgather", "randk:ratio=0.05",
                                  "threshold:lam=1.0,capacity=0.05,exchange=allgather",
                                  "threshold:lam=0.2,capacity=0.02,exchange=allgather"])
@pytest.mark.parametrize("gpu_forms", [False, True])
def test_sparsifier_results_do_not_depend_on_which_tensors_share_a_call(spec: str, gpu_forms: bool) -> None:
    gen = torch.Generator().manual_seed(11)
    grads = {n: torch.randn(3, *s, generator=gen) for n, s in SHAPES.items()}
    with device_forms() if gpu_forms else torch.no_grad():
        whole = _reduce(spec, [list(SHAPES)], grads)
        apart = _reduce(spec, [[n] for n in SHAPES], grads)
        mixed = _reduce(spec, [["d", "b"], ["c", "a"]], grads)
    for name in SHAPES:
        for other in (apart, mixed):
            assert torch.equal(whole[name][0], other[name][0]), name
            assert torch.equal(whole[name][1], other[name][1]), name


def test_randk_draws_change_with_the_step_and_resume_exactly() -> None:
    grads = {n: torch.randn(3, *s) for n, s in SHAPES.items()}
    one, again, later = (_reduce("randk:ratio=0.1", [list(SHAPES)], grads, step) for step in (3, 3, 4))
    for name in SHAPES:
        assert torch.equal(one[name][0], again[name][0])
    assert any(not torch.equal(one[n][0] != 0, later[n][0] != 0) for n in SHAPES)


def test_threshold_capacity_is_validated_and_round_trips() -> None:
    with pytest.raises(ValueError, match=r"`capacity` must be in \(0, 1\], got 0.0"):
        gradzip.HardThreshold(lam=1.0, capacity=0.0)
    comp = gradzip.compressor_from_spec("threshold:lam=0.5,capacity=0.1")
    assert comp.capacity == 0.1 and comp.device_decisions and comp.slots_for(1000) == 100
    assert gradzip.compressor_from_spec(comp.spec()) == comp
    budget = gradzip.compressor_from_spec("threshold:budget=0.05,capacity=0.1")
    assert budget.fixed_capacity and not budget.device_decisions and budget.slots_for(1000) == 100
    plain = gradzip.compressor_from_spec("threshold:lam=0.5")  # the default: exchanged sizes
    assert not plain.fixed_capacity and not plain.device_decisions


def test_pieces_cut_in_order_under_the_bound_and_keep_an_oversized_tensor_alone() -> None:
    assert pieces([]) == []
    assert pieces([3, 3, 3], most=6) == [(0, 2), (2, 3)]
    assert pieces([7, 1, 1], most=6) == [(0, 1), (1, 3)]
    assert pieces([1, 7, 1], most=6) == [(0, 1), (1, 2), (2, 3)]
    assert pieces([2] * 5, most=6) == [(0, 3), (3, 5)]
    # The default bound is the layouts' (int32 flat positions).
    assert pieces([MAX_ENTRIES, 1]) == [(0, 1), (1, 2)]
    assert pieces([MAX_ENTRIES - 1, 1]) == [(0, 2)]
