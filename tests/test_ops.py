"""Property tests of the pure tensor operations."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradzip.ops import (
    code_width,
    generator_for,
    orthogonalize,
    pack_bits,
    packed_size,
    randk_indices,
    stable_hash,
    threshold_select,
    topk_abs,
    unpack_bits,
)

FAST = settings(max_examples=40, deadline=None)


@FAST
@given(bits=st.integers(1, 8), n=st.integers(0, 300), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip(bits: int, n: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (3, n), generator=gen, dtype=torch.int64).to(torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (3, packed_size(n, bits))
    assert torch.equal(unpack_bits(packed, bits, n), codes)


@FAST
@given(bits=st.integers(1, 8), n=st.integers(0, 100), seed=st.integers(0, 2**31 - 1))
def test_pack_layout_is_bit_j_of_code_i_at_position_i_bits_plus_j(bits: int, n: int, seed: int) -> None:
    """The wire layout, bit by bit: what other implementations must produce to interoperate."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n,), generator=gen, dtype=torch.int64)
    expected = [0] * packed_size(n, bits)
    for i, code in enumerate(codes.tolist()):
        for j in range(bits):
            if code >> j & 1:
                pos = i * bits + j
                expected[pos // 8] |= 1 << (pos % 8)
    assert pack_bits(codes.to(torch.uint8), bits).tolist() == expected


def test_unpack_rejects_truncated_message() -> None:
    packed = pack_bits(torch.ones(1, 16, dtype=torch.uint8), 3)
    try:
        unpack_bits(packed[:, :-1], 3, 16)
    except ValueError as err:
        assert "`packed` must hold at least 6 bytes" in str(err)
    else:  # pragma: no cover - the assertion below documents the failure
        raise AssertionError("truncated message accepted")


@FAST
@given(m=st.integers(0, 1000))
def test_code_width_is_minimal(m: int) -> None:
    w = code_width(m)
    assert m < 2**w
    assert w == 1 or m >= 2 ** (w - 1)


@FAST
@given(rows=st.integers(1, 3), n=st.integers(1, 400), frac=st.floats(0.001, 1.0), seed=st.integers(0, 10**6))
def test_topk_matches_torch_topk(rows: int, n: int, frac: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=gen)
    k = max(1, min(n, int(frac * n)))
    values, idx = topk_abs(x, k)
    assert values.shape == idx.shape == (rows, k)
    ref = torch.topk(x.abs(), k, dim=1).values
    assert torch.equal(values.abs().sort(dim=1).values, ref.sort(dim=1).values)
    assert torch.equal(torch.gather(x, 1, idx), values)


def test_topk_large_tensor_takes_the_sampled_path_and_stays_exact() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 200_000, generator=gen)
    x[1, :150_000] = 0.0  # a skewed row: the sample sees mostly zeros
    for k in (1, 100, 2000):
        values, idx = topk_abs(x, k)
        ref = torch.topk(x.abs(), k, dim=1).values
        assert torch.equal(values.abs().sort(dim=1).values, ref.sort(dim=1).values)
        assert idx.unique(dim=None).numel() >= k  # distinct within rows (checked below too)
        for row in range(2):
            assert idx[row].unique().numel() == k


@FAST
@given(n=st.integers(1, 300), lam=st.floats(0.0, 3.0), seed=st.integers(0, 10**6))
def test_threshold_select_is_exactly_the_large_entries(n: int, lam: float, seed: int) -> None:
    x = torch.randn(2, n, generator=torch.Generator().manual_seed(seed))
    values, indices = threshold_select(x, lam)
    for row in range(2):
        expected = torch.nonzero(x[row].abs() >= lam).squeeze(1)
        assert torch.equal(indices[row], expected)
        assert torch.equal(values[row], x[row, expected])


@FAST
@given(n=st.integers(1, 500), frac=st.floats(0.001, 1.0), seed=st.integers(0, 100), step=st.integers(0, 100))
def test_randk_indices_shared_and_distinct(n: int, frac: float, seed: int, step: int) -> None:
    k = max(1, min(n, int(frac * n)))
    a = randk_indices(n, k, seed, step, "w")
    b = randk_indices(n, k, seed, step, "w")
    assert torch.equal(a, b)
    assert a.unique().numel() == k
    assert int(a.min()) >= 0 and int(a.max()) < n


def test_generators_are_stable_and_keyed() -> None:
    assert stable_hash("a", 1) == stable_hash("a", 1)
    assert stable_hash("a", 1) != stable_hash("a", 2)
    x = torch.rand(4, generator=generator_for("k", 1))
    y = torch.rand(4, generator=generator_for("k", 1))
    z = torch.rand(4, generator=generator_for("k", 2))
    assert torch.equal(x, y) and not torch.equal(x, z)


def test_global_rng_untouched() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    randk_indices(1000, 10, 0, 0, "w")
    torch.rand(3, generator=generator_for("x"))
    assert torch.equal(before, torch.get_rng_state())


@FAST
@given(n=st.integers(1, 40), r=st.integers(1, 5), seed=st.integers(0, 1000))
def test_orthogonalize_gives_orthonormal_columns(n: int, r: int, seed: int) -> None:
    r = min(r, n)
    p = torch.randn(2, n, r, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    q = orthogonalize(p)
    eye = torch.eye(r, dtype=torch.float64).expand(2, r, r)
    assert torch.allclose(q.transpose(-1, -2) @ q, eye, atol=1e-8)


def test_orthogonalize_zero_input_gives_unit_vectors_not_nan() -> None:
    for r in (1, 3):
        q = orthogonalize(torch.zeros(5, r))
        assert torch.isfinite(q).all()
        assert torch.allclose(q.norm(dim=0), torch.ones(r))


@FAST
@given(
    bits=st.integers(1, 8),
    n=st.one_of(st.integers(0, 300), st.integers(70_000, 140_000)),
    rows=st.integers(1, 5),
    extra=st.integers(0, 9),
    seed=st.integers(0, 2**31 - 1),
)
def test_unpack_fast_path_equals_the_torch_path(bits: int, n: int, rows: int, extra: int, seed: int) -> None:
    """The CPU's NumPy unpacking (table and field spreading, chunked) against the portable
    shift-and-mask definition, with trailing bytes beyond the codes."""
    from gradzip.ops import bits as bits_module

    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (rows, n), generator=gen, dtype=torch.int64).to(torch.uint8)
    tail = torch.randint(0, 256, (rows, extra), generator=gen, dtype=torch.int64).to(torch.uint8)
    packed = torch.cat([pack_bits(codes, bits), tail], dim=1)
    fast = unpack_bits(packed, bits, n)
    saved = bits_module._NUMPY_PATH
    try:
        bits_module._NUMPY_PATH = False
        portable = unpack_bits(packed, bits, n)
    finally:
        bits_module._NUMPY_PATH = saved
    assert fast.dtype == torch.uint8 and fast.shape == (rows, n)
    assert torch.equal(fast, codes) and torch.equal(portable, codes)
    # Leading dimensions are kept.
    assert torch.equal(unpack_bits(packed.reshape(1, rows, -1), bits, n), codes.reshape(1, rows, n))


def test_pack_leaves_its_input_unchanged() -> None:
    """One group of one-bit codes used to be packed in place of the caller's tensor."""
    codes = torch.tensor([[1, 0, 1, 1, 0, 0, 0, 1]], dtype=torch.uint8)
    before = codes.clone()
    packed = pack_bits(codes, 1)
    assert torch.equal(codes, before)
    assert packed.tolist() == [[0b10001101]]


@pytest.mark.parametrize("bits", [1, 3, 8])
def test_unpack_never_returns_or_aliases_its_input(bits: int) -> None:
    """At 8 bits the codes are the bytes themselves, and unpacking used to hand the caller's
    tensor back: writing into the codes then changed the message."""
    packed = pack_bits((torch.arange(16).reshape(2, 8) % (1 << bits)).to(torch.uint8), bits)
    before = packed.clone()
    codes = unpack_bits(packed, bits, 8)
    assert codes is not packed
    assert codes.untyped_storage().data_ptr() != packed.untyped_storage().data_ptr()
    codes.fill_(7)
    assert torch.equal(packed, before)


@FAST
@given(
    bits=st.integers(1, 8),
    n=st.one_of(st.integers(0, 300), st.integers(70_000, 140_000)),
    rows=st.integers(1, 5),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_fast_path_equals_the_torch_path(bits: int, n: int, rows: int, seed: int) -> None:
    """The CPU's NumPy packing (``packbits``, field gathering in chunks) gives the portable
    path's bytes, contiguous, with leading dimensions kept."""
    from gradzip.ops import bits as bits_module

    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (2, rows, n), generator=gen, dtype=torch.int64).to(torch.uint8)
    fast = pack_bits(codes, bits)
    saved = bits_module._NUMPY_PATH
    try:
        bits_module._NUMPY_PATH = False
        portable = pack_bits(codes, bits)
    finally:
        bits_module._NUMPY_PATH = saved
    assert fast.shape == (2, rows, packed_size(n, bits)) and fast.is_contiguous()
    assert torch.equal(fast, portable)


def test_pack_is_a_view_of_tensors_that_already_lie_one_after_another() -> None:
    from gradzip.ops.flat import pack, unpack
    parts = [torch.randn(2, 3), torch.randn(4), torch.randn(1, 2, 2)]
    flat = pack(parts)  # separate tensors: one concatenation
    assert flat.shape == (14,) and all(flat.data_ptr() != p.data_ptr() for p in parts)
    views = unpack(flat, [p.shape for p in parts])
    assert all(torch.equal(v, p) and v.shape == p.shape for v, p in zip(views, parts, strict=True))
    again = pack(views)  # the views lie one after another: no copy
    assert again.data_ptr() == flat.data_ptr() and torch.equal(again, flat)
    assert pack(views[1:]).data_ptr() == views[1].data_ptr()
    gap = pack([views[0], views[2]])  # not adjacent: copied
    assert gap.data_ptr() != flat.data_ptr()
    assert torch.equal(gap, torch.cat([parts[0].reshape(-1), parts[2].reshape(-1)]))
    with pytest.raises(AssertionError):
        unpack(flat, [torch.Size([3])])


def test_extremes_test_is_nan_exactly_where_an_entry_is_not_finite() -> None:
    from gradzip.ops.finite import extremes_test, finite_rows
    x = torch.tensor([3e38, -3.4e38, 1.0, -0.0])  # huge but finite: never an overflow
    assert extremes_test(x).item() == 0.0
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[2] = bad
        assert extremes_test(y).isnan().item()
        assert finite_rows([y.reshape(1, -1)], 1).tolist() == [False]
        assert finite_rows([y.reshape(2, -1)], 2).tolist() == [True, False]
    assert finite_rows([x.reshape(1, -1)], 1).tolist() == [True]


def test_per_matrix_absmax_equals_one_amax_per_matrix() -> None:
    from gradzip.ops.segments import matrix_index, per_matrix_absmax
    sizes, counts = [12, 10, 6], [3, 1, 2]
    index = matrix_index(sizes, counts, torch.device("cpu"))
    assert index.tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 10 + [4] * 3 + [5] * 3
    x = torch.randn(28)
    want = torch.cat([p.reshape(c, -1).abs().amax(1) for p, c in zip(x.split(sizes), counts, strict=True)])
    assert torch.equal(per_matrix_absmax(x, index, 6), want)
    x[13] = float("nan")
    got = per_matrix_absmax(x, index, 6)
    assert got[3].isnan() and torch.equal(got[[0, 1, 2, 4, 5]], want[[0, 1, 2, 4, 5]])
    with pytest.raises(ValueError, match="multiple of its count"):
        matrix_index([10], [3], torch.device("cpu"))


@pytest.mark.parametrize(("rows", "r"), [(1001, 2), (24, 3), (10, 1), (7, 1)])
def test_orthonormal_of_a_batch_is_each_matrix_alone_bit_for_bit(rows: int, r: int) -> None:
    """LAPACK rounds with the alignment of its working copy, where a batch places each
    matrix after the others: the rows are padded so every matrix sits at an aligned place."""
    from gradzip.ops.lowrank import orthonormal

    pt = torch.randn(5, r, rows, generator=torch.Generator().manual_seed(rows))
    batch = orthonormal(pt)
    for b in range(5):
        assert torch.equal(batch[b], orthonormal(pt[b:b + 1].clone())[0]), b
        assert torch.equal(batch[b], orthonormal(pt[b])), b  # no batch axis at all


def test_aligned_matrices_place_every_matrix_at_a_boundary() -> None:
    from gradzip.ops.lowrank import ALIGN_BYTES, aligned_matrices

    first, second = aligned_matrices((3,), [(4, 5, 7), (2, 3, 3)], dtype=torch.float32,
                                     device="cpu", zero=True)
    assert first.shape == (3, 4, 5, 7) and second.shape == (3, 2, 3, 3)
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    for batch in (first, second):
        assert not batch.any()
        for w in range(3):
            for b in range(batch.shape[1]):
                assert batch[w, b].is_contiguous() and batch[w, b].data_ptr() % ALIGN_BYTES == 0
