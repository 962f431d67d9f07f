"""The quantisers' whole-message helpers: layouts, per-segment sums, keyed draws, and the
properties QSGD and Sign take from them (each tensor's bits independent of its call-mates,
the same draws in every form, no global generator)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradzip
from gradzip.compressors.base import Job, StepContext
from gradzip.ops.branches import device_forms
from gradzip.ops.segquant import (
    UNIT,
    join_rows,
    key32,
    keyed_draws,
    keyed_uniform,
    segment_layout,
    segment_sums,
)

FAST = settings(max_examples=40, deadline=None)


@FAST
@given(numels=st.lists(st.integers(0, 50), min_size=1, max_size=6), size=st.integers(0, 9))
def test_layout_maps_every_entry_to_its_segment_tensor_and_position(numels: list[int],
                                                                     size: int) -> None:
    layout = segment_layout(numels, size)
    segment, owner, position, lengths = [], [], [], []
    for t, n in enumerate(numels):
        per = n if size == 0 else min(size, n)
        first = len(lengths)
        count = 0 if n == 0 else -(-n // per)
        lengths += [min(per, n - b * per) for b in range(count)]
        for i in range(n):
            segment.append(first + i // per)
            owner.append(t)
            position.append(i)
    assert layout.segments == len(lengths) and layout.total == sum(numels)
    assert layout.segment.tolist() == segment
    assert layout.owner.tolist() == owner
    assert layout.position.tolist() == position
    assert layout.lengths.tolist() == [float(m) for m in lengths]
    assert sum(layout.per_tensor) == layout.segments


def test_layout_validates_and_is_cached() -> None:
    with pytest.raises(ValueError, match="`numels` must be a non-empty sequence"):
        segment_layout([])
    with pytest.raises(ValueError, match="got \\(3, -1\\)"):
        segment_layout([3, -1])
    with pytest.raises(ValueError, match="`segment_size` must be >= 0, got -2"):
        segment_layout([3], -2)
    assert segment_layout([4, 5], 2) is segment_layout((4, 5), 2)
    # int32 indices, one tensor for both where every segment is a whole tensor (memory).
    whole = segment_layout([4, 5])
    assert whole.segment is whole.owner and whole.owner.dtype == torch.int32
    assert segment_layout([4, 5], 2).segment is not segment_layout([4, 5], 2).owner


@FAST
@given(numels=st.lists(st.integers(0, 300), min_size=1, max_size=5), size=st.sampled_from([0, 1, 7, 64]),
       rows=st.integers(1, 3), seed=st.integers(0, 2**31 - 1), exponent=st.integers(-30, 30))
def test_each_segment_sum_is_that_of_its_tensor_alone(numels: list[int], size: int, rows: int,
                                                      seed: int, exponent: int) -> None:
    """A tensor's segment sums do not depend on the tensors sharing its call, and they are
    the float64 sums of its entries (checked against an exactly rounded sum)."""
    gen = torch.Generator().manual_seed(seed)
    layout = segment_layout(numels, size)
    values = torch.rand(rows, layout.total, generator=gen) * 2.0**exponent
    got = segment_sums(values, layout.segment, layout.segments)
    start, first = 0, 0
    for n, count in zip(numels, layout.per_tensor, strict=True):
        alone = segment_layout([n], size)
        mine = values[:, start : start + n]
        want = segment_sums(mine, alone.segment, alone.segments)
        assert torch.equal(got[:, first : first + count], want)
        per = max(1, n if size == 0 else min(size, n))
        for r in range(rows):
            for b in range(count):
                exact = math.fsum(mine[r, b * per : (b + 1) * per].double().tolist())
                assert math.isclose(float(want[r, b]), exact, rel_tol=1e-12, abs_tol=0.0)
        start, first = start + n, first + count


def test_an_empty_segment_list_sums_to_nothing_and_owner_sums_give_zeros() -> None:
    layout = segment_layout([0, 3, 0])
    values = torch.tensor([[1.0, 2.0, 4.0]])
    assert layout.segments == 1
    assert segment_sums(values, layout.owner, 3).tolist() == [[0.0, 7.0, 0.0]]


def test_join_rows_views_a_buffer_and_copies_otherwise() -> None:
    buffer = torch.arange(10.0)
    parts = [buffer[0:4].view(2, 2), buffer[4:10]]
    joined = join_rows([p[None] for p in parts], 1)
    assert joined.data_ptr() == buffer.data_ptr() and joined.tolist() == [buffer.tolist()]
    apart = [torch.ones(1, 2), torch.zeros(1, 3)]
    assert join_rows(apart, 1).tolist() == [[1.0, 1.0, 0.0, 0.0, 0.0]]
    rows = [torch.arange(6.0).view(2, 3), torch.arange(4.0).view(2, 2)]
    assert join_rows(rows, 2).tolist() == [[0.0, 1.0, 2.0, 0.0, 1.0], [3.0, 4.0, 5.0, 2.0, 3.0]]


@FAST
@given(numels=st.lists(st.integers(0, 400), min_size=1, max_size=5),
       keys=st.lists(st.integers(0, 2**32 - 1), min_size=5, max_size=5))
def test_draws_are_the_same_in_every_form_and_every_call(numels: list[int], keys: list[int]) -> None:
    """The CPU's NumPy form and the torch form other devices run give the same bits, and a
    tensor's draws are those it gets alone in a call (they depend on its key and positions)."""
    layout = segment_layout(numels)
    rows = [keys[: len(numels)], keys[::-1][: len(numels)]]
    host = keyed_draws(rows, layout, "cpu")
    with device_forms():
        device = keyed_draws(rows, layout, "cpu")
    assert host.dtype == torch.float32 and device.dtype == torch.int64
    assert torch.equal(host.to(torch.int64), device)
    assert all(0 <= v < 2**24 for v in host.reshape(-1).tolist())
    start = 0
    for t, n in enumerate(numels):
        alone = keyed_draws([[rows[0][t]], [rows[1][t]]], segment_layout([n]), "cpu")
        assert torch.equal(host[:, start : start + n], alone)
        start += n


def test_draws_are_uniform_and_differ_between_keys() -> None:
    layout = segment_layout([200_000])
    u = keyed_uniform([[key32("qsgd", 0, 5, "w", 0)]], layout, "cpu")[0]
    assert u.dtype == torch.float32
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    # Mean and variance of U[0, 1) within a few standard errors (fixed keys: deterministic).
    assert abs(float(u.double().mean()) - 0.5) < 4 * math.sqrt(1 / 12 / u.numel())
    assert abs(float(u.double().var()) - 1 / 12) < 0.002
    counts = torch.histc(u, bins=16, min=0.0, max=1.0)
    assert float(counts.min()) > 0.95 * u.numel() / 16
    other = keyed_uniform([[key32("qsgd", 0, 5, "w", 1)]], layout, "cpu")[0]
    assert float((u == other).double().mean()) < 1e-3
    # Neighbouring entries are not correlated.
    centred = u.double() - 0.5
    assert abs(float((centred[1:] * centred[:-1]).mean())) < 0.002
    assert torch.equal(keyed_draws([[7]], layout, "cpu").to(torch.float32) * UNIT,
                       keyed_uniform([[7]], layout, "cpu"))


def test_draws_validate_their_keys() -> None:
    with pytest.raises(ValueError, match="`keys` must hold rows of 2 keys"):
        keyed_draws([[1]], segment_layout([3, 4]), "cpu")


def _reduce(spec: str, calls: list[list[str]], grads: dict[str, torch.Tensor], workers: int,
            step: int = 3) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    compressor = gradzip.compressor_from_spec(spec)
    shapes = {name: g.shape[1:] for name, g in grads.items()}
    state = compressor.init_group_state(shapes, workers, workers)
    ctx = StepContext(step=step, ranks=tuple(range(workers)), world_size=workers)
    out = {}
    for call in calls:
        jobs = [Job(name, grads[name].clone()) for name in call]
        compressor.reduce(jobs, state, gradzip.SimulatedGroup(workers), ctx)
        out.update({job.name: (job.averaged, job.own_decoded()) for job in jobs})
    return out


@pytest.mark.parametrize("spec", ["qsgd:levels=4,exchange=allgather",
                                  "qsgd:levels=16,bucket_size=100,exchange=allgather",
                                  "sign:exchange=allgather"])
@pytest.mark.parametrize("forms", ["cpu", "device"])
def test_a_tensor_gets_the_same_bits_whatever_shares_its_call(spec: str, forms: str) -> None:
    """Norms, scales and noise are each tensor's own: reducing the tensors together or one
    call each gives the same averages and the same decoded messages, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    grads = {"a": torch.randn(3, 5, 7, generator=gen), "b": torch.randn(3, 1000, generator=gen),
             "c": torch.randn(3, 64, generator=gen) * 1e-3, "d": torch.randn(3, 1000, generator=gen)}
    with device_forms() if forms == "device" else _nothing():
        together = _reduce(spec, [["a", "b", "c", "d"]], grads, 3)
        apart = _reduce(spec, [["d"], ["b", "a"], ["c"]], grads, 3)
    for name in grads:
        for x, y in zip(together[name], apart[name], strict=True):
            assert torch.equal(x, y), name


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("spec", ["qsgd:levels=4,exchange=allgather", "qsgd:levels=4,exchange=sharded"])
def test_qsgd_leaves_the_global_generator_alone_and_draws_per_step_and_rank(spec: str) -> None:
    gen = torch.Generator().manual_seed(4)
    grads = {"w": torch.randn(2, 3000, generator=gen)}
    before = torch.get_rng_state()
    first = _reduce(spec, [["w"]], grads, 2, step=3)
    assert torch.equal(torch.get_rng_state(), before)
    again = _reduce(spec, [["w"]], grads, 2, step=3)
    later = _reduce(spec, [["w"]], grads, 2, step=4)
    assert torch.equal(first["w"][0], again["w"][0])
    assert not torch.equal(first["w"][0], later["w"][0])
    # The two workers round the same gradient with different draws.
    same = {"w": grads["w"][:1].expand(2, -1).clone()}
    both = _reduce(spec, [["w"]], same, 2)["w"][1]
    assert not torch.equal(both[0], both[1])


def test_qsgd_zero_and_non_finite_buckets_give_codes_in_range() -> None:
    """A zero bucket decodes to zeros; a non-finite one still decodes (its result is the
    engine's to discard)."""
    grads = {"z": torch.zeros(1, 50), "n": torch.tensor([[1.0, float("nan"), 2.0]]),
             "i": torch.tensor([[float("inf"), 1.0]])}
    out = _reduce("qsgd:levels=3,exchange=allgather", [["z", "n", "i"]], grads, 1)
    assert torch.equal(out["z"][0], torch.zeros(50))
    assert out["n"][0].shape == (3,) and out["i"][0].shape == (2,)
