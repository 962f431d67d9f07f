"""The table and chunked decoders of Sign and QSGD give exactly what the plain definitions give."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradzip
from gradzip.compressors import qsgd as qsgd_module
from gradzip.compressors import sign as sign_module
from gradzip.compressors.base import Job, StepContext
from gradzip.compressors.qsgd import QSGD
from gradzip.ops.bits import bit_keys, keys_per_byte, pack_bits
from gradzip.ops.segquant import segment_layout

FAST = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _parts(row: torch.Tensor, numels: list[int]) -> list[torch.Tensor]:
    """Each tensor's part of an average row (the tensors end to end)."""
    assert row.shape == (sum(numels),)
    return list(row.split(numels))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@FAST
@given(
    workers=st.integers(1, 12),
    extra=st.integers(0, 2),
    numels=st.lists(st.integers(1, 5000), min_size=1, max_size=4),
    exponent=st.integers(-30, 30),
    seed=st.integers(0, 2**31 - 1),
)
def test_sign_table_equals_the_worker_by_worker_sum(
    workers: int, extra: int, numels: list[int], exponent: int, seed: int
) -> None:
    """Tensors at any bit offset in the stream, any scales, up to eight workers in the table and
    the rest added one by one: every bit of every average is the plain accumulation's."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(numels)
    bits = torch.randint(0, 2, (workers, total), generator=gen, dtype=torch.uint8)
    scales = torch.rand(workers, len(numels), generator=gen) * 10.0**exponent
    row = sign_module._average_by_table(numels, pack_bits(bits, 1), scales, workers + extra)
    start = 0
    for t, (numel, got) in enumerate(zip(numels, _parts(row, numels), strict=True)):
        ref = sign_module._sign_average(bits[:, start : start + numel], scales[:, t], workers + extra)
        start += numel
        assert _same_bits(got, ref)


def test_sign_table_with_an_infinite_scale_matches_too() -> None:
    bits = torch.tensor([[1, 0, 1, 0, 1, 1, 0], [1, 1, 0, 0, 1, 0, 1]], dtype=torch.uint8)
    scales = torch.tensor([[float("inf")], [2.0]])
    row = sign_module._average_by_table([7], pack_bits(bits, 1), scales, 2)
    assert _same_bits(row, sign_module._sign_average(bits, scales[:, 0], 2))


@pytest.mark.parametrize("workers", range(1, 9))
def test_bit_keys_hold_entry_j_of_worker_w_at_bit_j_times_workers_plus_w(workers: int) -> None:
    gen = torch.Generator().manual_seed(workers)
    bits = torch.randint(0, 2, (workers, 64), generator=gen, dtype=torch.uint8)
    keys = bit_keys(pack_bits(bits, 1).numpy()).tolist()
    e = keys_per_byte(workers)
    assert e * workers <= 8 and len(keys) == 64 // e
    for q, key in enumerate(keys):
        for j in range(e):
            for w in range(workers):
                assert (key >> (j * workers + w)) & 1 == int(bits[w, q * e + j])


@pytest.mark.parametrize("workers", [2, 9])
def test_sign_reduce_is_the_same_through_the_table_and_without_it(
    workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two workers are looked up whole; of nine, eight are looked up and one added."""
    shapes = {"a": torch.Size([3]), "b": torch.Size([5, 7]), "c": torch.Size([1001])}
    gen = torch.Generator().manual_seed(11)
    grads = {n: torch.randn(workers, *s, generator=gen) for n, s in shapes.items()}
    ctx = StepContext(step=0, ranks=tuple(range(workers)), world_size=workers)

    def run() -> list[torch.Tensor]:
        jobs = [Job(n, g.clone()) for n, g in grads.items()]
        compressor = gradzip.compressor_from_spec("sign")
        compressor.reduce(jobs, compressor.init_state(shapes), gradzip.SimulatedGroup(workers), ctx)
        return [job.averaged for job in jobs]

    with_table = run()
    monkeypatch.setattr(sign_module, "MAX_KEY_WORKERS", 0)
    without = run()
    for a, b in zip(with_table, without, strict=True):
        assert _same_bits(a, b)


def _decode_sum_whole(q: QSGD, norms: torch.Tensor, codes: torch.Tensor, numel: int, divisor: int) -> torch.Tensor:
    """The whole-tensor definition: every row added into the padded [buckets, size] sum."""
    rows = codes.shape[0]
    buckets, size = q._layout(numel)
    padded = torch.nn.functional.pad(codes, (0, buckets * size - numel)).reshape(rows, buckets, size)
    steps = (norms / q.levels).unsqueeze(2)
    total = torch.zeros(buckets, size, dtype=torch.float32)
    for row in range(rows):
        total.addcmul_(padded[row], steps[row])
    offsets = norms[0].clone()
    for row in range(1, rows):  # the norms' sum, added in rank order
        offsets += norms[row]
    total.sub_(offsets.unsqueeze(1))
    return total.reshape(-1)[:numel].div_(divisor)


@FAST
@given(
    workers=st.integers(1, 8),
    levels=st.integers(1, 127),
    bucket_size=st.sampled_from([0, 0, 7, 300, 2048, 2053]),
    numel=st.integers(1, 9000),
    exponent=st.integers(-20, 20),
    seed=st.integers(0, 2**31 - 1),
)
def test_qsgd_chunked_decode_equals_the_whole_tensor_sum(
    workers: int, levels: int, bucket_size: int, numel: int, exponent: int, seed: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chunks of 2048 entries, so one bucket spans several chunks and buckets of 2048+ entries
    are chunked too."""
    monkeypatch.setattr(qsgd_module, "_CHUNK", 2048)
    gen = torch.Generator().manual_seed(seed)
    q = QSGD(levels=levels, bucket_size=bucket_size)
    buckets, _ = q._layout(numel)
    # A slice of wider rows, as one tensor's codes are within a call's stream.
    stream = torch.randint(0, 2 * levels + 1, (workers, numel + 3), generator=gen, dtype=torch.uint8)
    codes = stream[:, 1 : numel + 1]
    norms = torch.rand(workers, buckets, generator=gen) * 10.0**exponent
    got = q._decode_sum(norms, codes, numel, workers + 1)
    assert _same_bits(got, _decode_sum_whole(q, norms, codes, numel, workers + 1))


def test_qsgd_decode_of_a_large_tensor_matches_at_the_default_chunk() -> None:
    gen = torch.Generator().manual_seed(2)
    q = QSGD()
    numel = 3 * qsgd_module._CHUNK + 5
    codes = torch.randint(0, 17, (4, numel), generator=gen, dtype=torch.uint8)
    norms = torch.rand(4, 1, generator=gen) * 50
    assert _same_bits(q._decode_sum(norms, codes, numel, 4), _decode_sum_whole(q, norms, codes, numel, 4))


@FAST
@given(
    workers=st.integers(1, 9),
    levels=st.integers(1, 127),
    bucket_size=st.sampled_from([0, 1, 7, 100]),
    numels=st.lists(st.integers(0, 700), min_size=1, max_size=6),
    seed=st.integers(0, 2**31 - 1),
)
def test_qsgd_decode_of_a_whole_call_equals_each_tensor_alone(
    workers: int, levels: int, bucket_size: int, numels: list[int], seed: int
) -> None:
    """The whole-call sum (off the CPU: every tensor of a call decoded at once) gives each
    tensor the bits its own whole-tensor sum gives."""
    gen = torch.Generator().manual_seed(seed)
    q = QSGD(levels=levels, bucket_size=bucket_size)
    layout = segment_layout(numels, bucket_size)
    codes = torch.randint(0, 2 * levels + 1, (workers, sum(numels)), generator=gen, dtype=torch.uint8)
    norms = torch.rand(workers, layout.segments, generator=gen) * 100
    got = q._decode_sum_whole(norms, codes, layout, workers + 1)
    start, first = 0, 0
    for numel, buckets in zip(numels, layout.per_tensor, strict=True):
        want = _decode_sum_whole(q, norms[:, first : first + buckets], codes[:, start : start + numel],
                                 numel, workers + 1)
        assert _same_bits(got[start : start + numel], want)
        start, first = start + numel, first + buckets


@FAST
@given(
    workers=st.integers(1, 40),
    numels=st.lists(st.integers(0, 3000), min_size=1, max_size=6),
    exponent=st.integers(-30, 30),
    seed=st.integers(0, 2**31 - 1),
)
def test_sign_average_of_all_tensors_together_equals_each_alone(
    workers: int, numels: list[int], exponent: int, seed: int
) -> None:
    """The decoding that runs off the CPU (every tensor of a call at once) gives every
    tensor the bits of its own worker-by-worker sum."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(numels)
    bits = torch.randint(0, 2, (workers, total), generator=gen, dtype=torch.uint8)
    scales = torch.rand(workers, len(numels), generator=gen) * 10.0**exponent
    owner = torch.repeat_interleave(torch.arange(len(numels)), torch.tensor(numels))
    row = sign_module._average_together(bits, scales, owner, workers + 1)
    start = 0
    for t, (numel, got) in enumerate(zip(numels, _parts(row, numels), strict=True)):
        ref = sign_module._sign_average(bits[:, start : start + numel], scales[:, t], workers + 1)
        start += numel
        assert _same_bits(got, ref)
