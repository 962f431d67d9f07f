"""Chunked Top-k and the bin-mean quantiser: their ops, byte formulas against the bytes sent,
and averaging over the workers that sent an entry."""

from __future__ import annotations

import math

import pytest
import torch

import gradzip
from gradzip.comm.base import allgather_wire_bytes, allreduce_wire_bytes
from gradzip.comm.header import HEADER_BYTES, rider_bytes
from gradzip.compressors.base import sparse_pays
from gradzip.ops.binmean import binmean_decode, binmean_encode
from gradzip.ops.chunks import chunk_flat_indices, chunk_topk, pack_wide, unpack_wide, wide_size


@pytest.mark.parametrize("bits", [1, 3, 8, 9, 12, 16])
def test_wide_packing_round_trips_at_exactly_the_bits_needed(bits: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    for count in (1, 7, 8, 33):
        codes = torch.randint(0, 1 << bits, (2, count), generator=gen)
        packed = pack_wide(codes, bits)
        assert packed.dtype == torch.uint8
        assert packed.shape == (2, wide_size(count, bits)) and wide_size(count, bits) == math.ceil(count * bits / 8)
        assert torch.equal(unpack_wide(packed, bits, count), codes)


def test_chunk_topk_keeps_the_largest_of_every_chunk_with_local_indices() -> None:
    x = torch.tensor([[0.1, -5.0, 0.3, 2.0, 0.0, -0.2, 9.0, 1.0, -3.0, 0.5]])
    values, flat, local = chunk_topk(x, chunk=4, k=2)
    # chunks [0:4], [4:8], then the partial [8:10] keeping both
    assert flat.tolist() == [[1, 3, 6, 7, 8, 9]]
    assert local.tolist() == [[1, 3, 2, 3, 0, 1]]
    assert values.tolist() == [[-5.0, 2.0, 9.0, 1.0, -3.0, 0.5]]
    assert torch.equal(chunk_flat_indices(local, 10, 4, 2), flat)
    with pytest.raises(ValueError, match="inside their chunk"):
        chunk_flat_indices(torch.tensor([[0, 0, 0, 0, 2, 0]]), 10, 4, 2)


def test_binmean_codes_decode_to_their_bins_mean() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 1000, generator=gen)
    codebook, codes = binmean_encode(x, 2, 6.0)
    assert codebook.shape == (2, 4) and codes.dtype == torch.uint8 and int(codes.max()) <= 3
    decoded = binmean_decode(codebook, codes)
    for row in range(2):
        for b in range(4):
            members = x[row][codes[row] == b]
            want = members.double().mean().float() if members.numel() else torch.tensor(0.0)
            assert torch.allclose(codebook[row, b], want, atol=1e-6)
    assert decoded.abs().max() <= x.abs().max()
    constant = torch.full((1, 5), 3.0)
    cb, c = binmean_encode(constant, 3, 6.0)
    assert torch.equal(binmean_decode(cb, c), constant)
    # 8 bits over +- 6 sigma: close to the input.
    cb8, c8 = binmean_encode(x, 8, 6.0)
    assert float((binmean_decode(cb8, c8) - x).norm() / x.norm()) < 0.03


SHAPES = {"w": torch.Size([40, 50]), "v": torch.Size([300]), "tiny": torch.Size([3])}


# The all-gather's formula: chunktopk is pinned to it (its sharded exchange, which "auto" picks
# where it costs less, has its own formula, tested in test_sharded_sparse.py).
@pytest.mark.parametrize("spec", [
    "chunktopk:chunk=256,k=8,exchange=allgather", "chunktopk:chunk=100,k=5,bits=2",
    "chunktopk:exchange=allgather", "binmean:exchange=allgather",
    "binmean:bits=3,exchange=allgather",
])
def test_bytes_sent_are_the_formula(spec: str) -> None:
    workers = 4
    engine = gradzip.Engine(SHAPES, spec, collective=gradzip.SimulatedGroup(workers), dense_1d=False)
    compressor = engine.compressor
    gen = torch.Generator().manual_seed(1)
    engine.reduce({n: torch.randn(workers, *s, generator=gen) for n, s in SHAPES.items()})
    # A tensor whose message would cost more than a dense all-reduce is sent dense (the
    # 3-entry one always; the 300-entry one under 8-bit codes, whose codebook is 1 KB).
    packed = {n: s.numel() for n, s in SHAPES.items()
              if sparse_pays(s.numel(), compressor.message_bytes(s.numel()), 1, engine.comm)}
    assert "w" in packed and "tiny" not in packed
    message = sum(compressor.message_bytes(numel) for numel in packed.values())
    dense = sum(4 * s.numel() for n, s in SHAPES.items() if n not in packed)
    stats = engine.stats
    assert stats["payload_bytes"] == [HEADER_BYTES + message + dense] * workers
    header_wire = 2 * (workers - 1) * HEADER_BYTES // workers
    dense_wire = 2 * (workers - 1) * dense // workers
    assert stats["wire_bytes"] == [header_wire + allgather_wire_bytes(message, workers) + dense_wire] * workers


def test_chunktopk_byte_formula_values() -> None:
    # SparseLoCo's setting: 64 of every 4,096 entries, 2-bit values, 12-bit indices.
    c = gradzip.ChunkTopK(chunk=4096, k=64, bits=2)
    assert c.index_bits == 12
    assert c.message_bytes(4096 * 10) == 4 * 4 + math.ceil(640 * 2 / 8) + math.ceil(640 * 12 / 8)
    assert gradzip.ChunkTopK(chunk=4096, k=64).message_bytes(5000) == (64 + 64) * 4 + math.ceil(128 * 12 / 8)
    assert gradzip.BinMean(bits=8).message_bytes(1000) == 4 * 256 + 1000


def test_average_over_senders_divides_each_entry_by_the_workers_that_sent_it() -> None:
    comm = gradzip.SimulatedGroup(3)
    grads = {"w": torch.tensor([[[5.0, 0.0, 0.0, 1.0]], [[0.0, 6.0, 0.0, 0.5]], [[7.0, 0.0, 0.1, 0.0]]])}
    senders = gradzip.Engine({"w": torch.Size([1, 4])}, "chunktopk:chunk=4,k=1,average=senders", collective=comm)
    everyone = gradzip.Engine({"w": torch.Size([1, 4])}, "chunktopk:chunk=4,k=1", collective=gradzip.SimulatedGroup(3))
    # Worker 0 sends 5 at 0, worker 1 sends 6 at 1, worker 2 sends 7 at 0.
    assert senders.reduce(grads)["w"].tolist() == [[6.0, 6.0, 0.0, 0.0]]
    assert torch.allclose(everyone.reduce(grads)["w"], torch.tensor([[4.0, 2.0, 0.0, 0.0]]))


@pytest.mark.parametrize(("spec", "message"), [
    ("chunktopk:chunk=1", "`chunk` must be in [2, 65536], got 1"),
    ("chunktopk:chunk=16,k=17", "`k` must be in [1, 16], got 17"),
    ("chunktopk:bits=9", "`bits` must be in [0, 8], got 9"),
    ("chunktopk:average=some", "`average` must be one of"),
    ("binmean:bits=0", "`bits` must be in [1, 8], got 0"),
    ("binmean:spread=0", "`spread` must be > 0, got 0"),
])
def test_bad_configuration_is_one_line_error(spec: str, message: str) -> None:
    with pytest.raises((TypeError, ValueError)) as info:
        gradzip.compressor_from_spec(spec)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_all_to_all_sends_part_j_to_worker_j_and_meters_it() -> None:
    comm = gradzip.SimulatedGroup(3)
    x = torch.arange(3 * 3 * 2, dtype=torch.float32).reshape(3, 3, 2)  # [sender, receiver, 2]
    out = comm.all_to_all(x)
    for receiver in range(3):
        for sender in range(3):
            assert torch.equal(out[receiver, sender], x[sender, receiver])
    assert comm.meter.payload == [3 * 8] * 3 and comm.meter.wire == [2 * 8] * 3
    with pytest.raises(ValueError, match="one part per worker"):
        comm.all_to_all(torch.zeros(3, 2, 2))


@pytest.mark.parametrize("workers", [2, 4, 8])
def test_scatterq_wire_bytes_are_the_formula_and_do_not_grow_with_workers(workers: int) -> None:
    shapes = {"w": torch.Size([64, 100]), "b": torch.Size([100])}
    engine = gradzip.Engine(shapes, "scatterq", collective=gradzip.SimulatedGroup(workers))
    gen = torch.Generator().manual_seed(workers)
    grads = {n: torch.randn(workers, *s, generator=gen) for n, s in shapes.items()}
    out = engine.reduce(grads, same_layout=True)  # the header rides in the first message
    # "b" (100 entries) is sent dense: a part's 1 KB codebook costs more than its fp32 ring.
    # The header rides in that all-reduce; "w" takes an all-to-all and an all-gather of one
    # part each (a codebook and ceil(6400 / W) 8-bit codes).
    assert engine.compressor.report(engine.compressor_state)["exchange"] == {
        "allgather": 0, "sharded": 1, "dense": 1}
    dense = 400 + rider_bytes(torch.float32, workers, summed=True)
    part = 4 * 256 + -(-6400 // workers)
    assert engine.stats["wire_bytes"] == [
        allreduce_wire_bytes(dense, workers) + 2 * (workers - 1) * part] * workers
    assert engine.stats["payload_bytes"] == [dense + (workers + 1) * part] * workers
    # Per worker: about 2 (W - 1) / W bytes per entry at 8 bits, a quarter of fp32's ring.
    assert 2 * (workers - 1) * part < 0.3 * engine.stats["dense_wire_bytes"][0] + 2 * (workers - 1) * 1024
    for name in shapes:
        want = grads[name].mean(0)
        assert float((out[name] - want).norm() / want.norm()) < 0.02
