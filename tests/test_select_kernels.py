"""The chunked, folded selection kernels give exactly what the plain definitions give."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradzip.ops import select

FAST = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 8192 entries, so multi-chunk rows and chunk tails stay cheap to test."""
    monkeypatch.setattr(select, "_CHUNK", 8192)


def _rows(seed: int, rows: int, n: int, heavy: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=gen)
    if heavy:  # a few huge entries and long zero runs, as in real gradients
        x = x * torch.rand(rows, n, generator=gen).pow(8) * 100
        x[:, : n // 3] = 0.0
    return x


@FAST
@given(
    n=st.integers(0, 30_000),
    lam=st.floats(0.05, 4.0),
    seed=st.integers(0, 10**6),
    heavy=st.booleans(),
)
def test_at_least_equals_nonzero(small_chunks: None, n: int, lam: float, seed: int, heavy: bool) -> None:
    row = _rows(seed, 1, n, heavy)[0]
    row[::97] = float("nan")
    expected = torch.nonzero(row.abs() >= lam).squeeze(1)
    with_nan = torch.nonzero(~(row.abs() < lam)).squeeze(1)
    assert torch.equal(select._at_least(row, lam), expected)  # NumPy path on the CPU
    assert torch.equal(select._at_least(row, lam, nan_too=True), with_nan)
    if n:  # the torch path other devices take
        assert torch.equal(select._at_least_torch(row, lam, False), expected)
        assert torch.equal(select._at_least_torch(row, lam, True), with_nan)
    assert torch.equal(select._at_least(row.double(), lam), expected)


@FAST
@given(n=st.integers(0, 100_000), density=st.floats(0.0, 1.0), seed=st.integers(0, 10**6))
def test_true_positions_equals_flatnonzero(n: int, density: float, seed: int) -> None:
    mask = np.random.default_rng(seed).random(n) < density
    assert np.array_equal(select._true_positions(mask), np.flatnonzero(mask))


@FAST
@given(
    n=st.integers(1, 30_000),
    lam=st.one_of(st.just(0.0), st.floats(0.05, 4.0)),
    seed=st.integers(0, 10**6),
)
def test_threshold_split_matches_its_definition(small_chunks: None, n: int, lam: float, seed: int) -> None:
    x = _rows(seed, 3, n, heavy=seed % 2 == 0)
    x[1, ::89] = float("nan")  # never selected: |NaN| >= lam is false
    x[2, 5::97] = -0.0
    values, indices, rest = select.threshold_split(x, lam)
    for row in range(3):
        mask = x[row].abs() >= lam
        assert torch.equal(indices[row], torch.nonzero(mask).squeeze(1))
        assert torch.equal(values[row], x[row][mask])
        # What stays behind: x where not selected (NaN included), +0.0 where selected.
        expected = torch.where(mask, torch.zeros(()), x[row])
        torch.testing.assert_close(rest[row], expected, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(rest[row].signbit(), x[row].signbit() & ~mask)


@pytest.mark.parametrize("heavy", [False, True])
@pytest.mark.parametrize("n", [65_536, 70_001, 200_003])
def test_topk_sampled_path_is_exact(small_chunks: None, n: int, heavy: bool) -> None:
    x = _rows(n, 2, n, heavy)
    for k in (1, n // 1000, n // 100, n // 9):
        values, idx = select.topk_abs(x, k)
        ref = torch.topk(x.abs(), k, dim=1).values
        assert torch.equal(values.abs().sort(dim=1).values, ref.sort(dim=1).values)
        assert torch.equal(torch.gather(x, 1, idx), values)
        for row in range(2):
            assert idx[row].unique().numel() == k


def test_topk_falls_back_when_the_sample_misjudges(small_chunks: None) -> None:
    # Every sampled position (a multiple of the stride) holds a huge value, so the estimated
    # cut lets fewer than k entries through and the row must fall back to a full top-k.
    n, k = 131_072, 1000
    x = torch.randn(1, n, generator=torch.Generator().manual_seed(5)) * 1e-3
    stride = n // 32768
    x[0, ::stride] = 0.0
    x[0, ::stride][:100] = 1e6
    x[0, 1::stride][:5000] = torch.linspace(1.0, 2.0, 5000)
    values, idx = select.topk_abs(x, k)
    ref = torch.topk(x.abs(), k, dim=1).values
    assert torch.equal(values.abs().sort(dim=1).values, ref.sort(dim=1).values)
    assert idx[0].unique().numel() == k


def test_nan_rows_fall_back_like_torch_topk() -> None:
    x = torch.randn(1, 100_000, generator=torch.Generator().manual_seed(1))
    x[0, 10] = float("nan")
    _, idx = select.topk_abs(x, 50)
    assert 10 in idx[0].tolist()  # torch.topk ranks NaN above everything


@FAST
@given(n=st.integers(4096, 200_000), frac=st.floats(0.0001, 0.25), seed=st.integers(0, 10**6))
def test_randk_sampled_path_distinct_sorted_shared(n: int, frac: float, seed: int) -> None:
    k = max(1, int(frac * n))
    a = select.randk_indices(n, k, seed, 3, "w")
    assert torch.equal(a, select.randk_indices(n, k, seed, 3, "w"))
    assert a.numel() == k and a.dtype == torch.int64
    assert bool((a[1:] > a[:-1]).all()) and int(a[0]) >= 0 and int(a[-1]) < n


def test_randk_sampled_path_is_uniform() -> None:
    # 4000 draws of 200 out of 8192: every position is kept with probability 200/8192, so
    # per-position counts have mean 97.7 and standard deviation 9.8; the first and last 512
    # positions (where a biased sampler would show) must look like the rest.
    n, k, draws = 8192, 200, 4000
    counts = torch.zeros(n)
    for seed in range(draws):
        counts[select.randk_indices(n, k, seed, 0, "u")] += 1
    expected = draws * k / n
    sd = (expected * (1 - k / n)) ** 0.5
    assert abs(float(counts.mean()) - expected) < 1e-9
    assert 0.85 * sd < float(counts.std()) < 1.15 * sd
    for part in (counts[:512], counts[-512:], counts[4000:4512]):
        assert abs(float(part.mean()) - expected) < 5 * sd / 512**0.5
