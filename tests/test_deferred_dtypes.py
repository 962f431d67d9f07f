"""The device-path finiteness test over tensors of several dtypes: same answers, and one
concatenation per dtype instead of a promoting copy of every tensor."""

from __future__ import annotations

import pytest
import torch

from gradzip.engine.deferred import any_nonfinite, nonfinite_rows_at_once


def _mixed() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(5, generator=g), torch.randn(3, 2, generator=g),
            torch.randn(4, generator=g, dtype=torch.float64), torch.randn(2, generator=g),
            torch.randn(6, generator=g, dtype=torch.float64), torch.arange(3)]


@pytest.mark.parametrize("where", [None, 0, 1, 2, 4])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_mixed_dtypes_same_answer(where: int | None, bad: float) -> None:
    tensors = _mixed()
    if where is not None:
        tensors[where].view(-1)[1] = bad
    expected = where is not None
    assert bool(any_nonfinite(tensors, torch.device("cpu"))) is expected
    assert nonfinite_rows_at_once(tensors, 1).tolist() == [expected]


def test_huge_finite_values_are_finite() -> None:
    tensors = [torch.full((3,), 3e38), torch.full((2,), 1e308, dtype=torch.float64)]
    assert not bool(any_nonfinite(tensors, torch.device("cpu")))


def test_only_integers_are_finite() -> None:
    tensors = [torch.arange(3), torch.ones(2, dtype=torch.int32)]
    assert not bool(any_nonfinite(tensors, torch.device("cpu")))


def test_no_copy_per_tensor() -> None:
    tensors = _mixed()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        any_nonfinite(tensors, torch.device("cpu"))
    names = [e.name for e in prof.events()]
    # Two dtype groups of floats: two concatenations, none of them promoting copies.
    assert names.count("aten::cat") == 2
    assert names.count("aten::copy_") < len(tensors) - 1
