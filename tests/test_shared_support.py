"""Shared-support Top-k: one set of blocks for every worker, chosen from summed block scores;
exact against a plain reference, bytes by the formula, independent of grouping, resumable, and
the same bits in gloo processes as in the simulator."""

from __future__ import annotations

import io

import pytest
import torch

import gloo_parity
import gradzip
from gradzip.comm.base import allreduce_wire_bytes, ordered_wire_bytes
from gradzip.compressors.base import Job, StepContext
from gradzip.ops.blocks import block_layout, block_positions, top_blocks

SHAPES = {"a.weight": torch.Size([24, 40]), "b.weight": torch.Size([333]),
          "c.weight": torch.Size([8, 8, 3]), "d.bias": torch.Size([5])}
SPEC = "sharedtopk:ratio=0.05,block=8"


def _grads(workers: int, step: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7919 * seed + step)
    return {n: torch.randn(workers, *s, generator=gen) for n, s in SHAPES.items()}


def _ctx(workers: int, step: int = 0) -> StepContext:
    return StepContext(step=step, ranks=tuple(range(workers)), world_size=workers)


def _reference(x: torch.Tensor, block: int, kept: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The exchange written out block by block for ``x[W, n]``: (average ``[n]``, residuals)."""
    world, n = x.shape
    bounds = [(lo, min(n, lo + block)) for lo in range(0, n, block)]
    scores = []
    for lo, hi in bounds:  # each worker's float64 sum of squares, rounded, summed in rank order
        per = [float((x[w, lo:hi].double() ** 2).sum()) for w in range(world)]
        total = torch.tensor(per[0], dtype=torch.float32)
        for p in per[1:]:
            total = total + torch.tensor(p, dtype=torch.float32)
        scores.append(float(total))
    order = sorted(range(len(bounds)), key=lambda b: (-scores[b], b))[:kept]
    average, residual = torch.zeros(n), x.clone()
    for b in order:
        lo, hi = bounds[b]
        acc = x[0, lo:hi].clone()
        for w in range(1, world):
            acc += x[w, lo:hi]
        average[lo:hi] = acc / world
        residual[:, lo:hi] = 0.0
    return average, residual


@pytest.mark.parametrize("workers", [1, 2, 3, 8])
def test_equals_the_reference_and_keeps_every_residual(workers: int) -> None:
    compressor = gradzip.compressor_from_spec(SPEC)
    comm = gradzip.SimulatedGroup(workers)
    jobs = [Job(n, g.clone()) for n, g in _grads(workers, 0).items()]
    compressor.reduce(jobs, {}, comm, _ctx(workers))
    for job in jobs:
        x = job.tensor.reshape(workers, -1)
        if not compressor.sends_sparse(job.numel):  # d.bias: 5 entries, one block costs more
            assert job.name == "d.bias"
            assert torch.allclose(job.averaged.reshape(-1), x.mean(0), atol=1e-6)
            continue
        want_avg, want_res = _reference(x, compressor.block, compressor.blocks_for(job.numel)[1])
        assert torch.equal(job.averaged.reshape(-1), want_avg), job.name
        residual = job.leftover()
        assert torch.equal(residual.reshape(workers, -1), want_res), job.name
        # One support: every worker sent the same entries, whole.
        sent = residual.reshape(workers, -1).eq(0) & x.ne(0)
        assert torch.equal(sent, sent[:1].expand_as(sent))
        assert torch.allclose(job.own_decoded().sum(0), workers * job.averaged, atol=1e-5)


def test_ties_go_to_the_lower_block_and_non_finite_scores_rank_first() -> None:
    layout = block_layout([40, 12], 4, [2, 1])
    scores = torch.tensor([1.0, 5.0, 5.0, 0.0, 5.0, 2.0, 2.0, 0.0, 9.0, 1.0,  # tensor 0
                           3.0, 3.0, 1.0])  # tensor 1: blocks 10, 11, 12
    assert top_blocks(scores, layout).tolist() == [8, 1, 10]
    scores[6] = float("inf")
    scores[12] = float("nan")
    assert top_blocks(scores, layout).tolist() == [6, 8, 12]
    # A shorter last block is padded with the call's padding slot (52).
    where = block_positions(torch.tensor([12]), layout)
    assert where.tolist() == [48, 49, 50, 51]
    where = block_positions(torch.tensor([9]), block_layout([38], 4, [1]))
    assert where.tolist() == [36, 37, 38, 38]


def test_a_worker_s_non_finite_entry_makes_the_average_non_finite() -> None:
    workers = 4
    compressor = gradzip.compressor_from_spec(SPEC)
    grads = _grads(workers, 0)
    grads["a.weight"][2, 3, 7] = float("inf")
    jobs = [Job(n, g) for n, g in grads.items()]
    compressor.reduce(jobs, {}, gradzip.SimulatedGroup(workers), _ctx(workers))
    assert not torch.isfinite(jobs[0].averaged).all()
    assert all(torch.isfinite(j.averaged).all() for j in jobs[1:])


def test_simulated_bytes_are_the_formula() -> None:
    compressor = gradzip.compressor_from_spec(SPEC)
    for workers in (2, 4, 8, 64):
        comm = gradzip.SimulatedGroup(workers)
        jobs = [Job(n, g) for n, g in _grads(workers, 0).items()]
        compressor.reduce(jobs, {}, comm, _ctx(workers))
        sparse = [s.numel() for s in SHAPES.values() if compressor.sends_sparse(s.numel())]
        blocks = sum(compressor.blocks_for(n)[0] for n in sparse)
        values = sum(compressor.blocks_for(n)[1] for n in sparse) * compressor.block
        dense = sum(s.numel() for s in SHAPES.values() if not compressor.sends_sparse(s.numel()))
        # Two ordered all-reduces: the scores, then the chosen values with the dense tensors;
        # each an all-to-all of W parts and an all-gather of one part.
        parts = [-(-m // workers) for m in (blocks, values + dense)]
        wire = sum(ordered_wire_bytes(m, 4, workers) for m in (blocks, values + dense))
        assert wire == sum(2 * (workers - 1) * 4 * p for p in parts)
        assert comm.meter.wire == [wire] * workers
        assert comm.meter.payload == [sum((workers + 1) * 4 * p for p in parts)] * workers
        assert comm.meter.calls == 4
    # The per-tensor formula: flat in W (up to whole parts), far below the dense ring.
    big = gradzip.compressor_from_spec("sharedtopk:ratio=0.01")
    n = 256 * 256
    cost = {w: big.wire_bytes(n, w) for w in (2, 8, 32, 128)}
    assert cost[128] <= 1.15 * cost[8]
    assert cost[2] == 4 * (n // 256 + 3 * 256)
    assert all(c < allreduce_wire_bytes(4 * n, w) / 30 for w, c in cost.items())


def test_all_reduce_ordered_adds_in_rank_order() -> None:
    for workers in (1, 3, 5):
        comm = gradzip.SimulatedGroup(workers)
        x = torch.randn(workers, 11, generator=torch.Generator().manual_seed(workers))
        total = x[0].clone()
        for w in range(1, workers):
            total += x[w]
        assert torch.equal(comm.all_reduce_ordered(x), total)
        assert comm.meter.wire == [ordered_wire_bytes(11, 4, workers)] * workers
    with pytest.raises(ValueError, match=r"`x` must be \[local workers, m\]"):
        gradzip.SimulatedGroup(2).all_reduce_ordered(torch.zeros(2, 3, 4))


def test_results_do_not_depend_on_grouping() -> None:
    workers = 4
    compressor = gradzip.compressor_from_spec(SPEC)
    grads = _grads(workers, 3)

    def run(groups: list[list[str]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        out, comm = {}, gradzip.SimulatedGroup(workers)
        for names in groups:
            jobs = [Job(n, grads[n].clone()) for n in names]
            compressor.reduce(jobs, {}, comm, _ctx(workers))
            out.update({j.name: (j.averaged, j.leftover()) for j in jobs})
        return out

    together = run([list(SHAPES)])
    apart = run([["c.weight"], ["a.weight", "d.bias"], ["b.weight"]])
    for name in SHAPES:
        assert torch.equal(together[name][0], apart[name][0]), name
        assert torch.equal(together[name][1], apart[name][1]), name


def test_state_dict_round_trip_resumes_bit_for_bit() -> None:
    workers = 8

    def engine() -> gradzip.Engine:
        return gradzip.Engine(SHAPES, SPEC, collective=gradzip.SimulatedGroup(workers))

    straight = engine()
    expected = [straight.reduce(_grads(workers, s)) for s in range(6)]
    first = engine()
    for s in range(3):
        first.reduce(_grads(workers, s))
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = engine()
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for s in range(3, 6):
        got = resumed.reduce(_grads(workers, s))
        for name in SHAPES:
            assert torch.equal(got[name], expected[s][name]), (s, name)
    assert resumed.stats == straight.stats


def test_spec_round_trips_and_is_validated() -> None:
    assert gradzip.compressor_from_spec(SPEC).spec() == SPEC
    assert gradzip.compressor_from_spec("sharedtopk").spec() == "sharedtopk"
    assert isinstance(gradzip.compressor_from_spec("sharedtopk"), gradzip.SharedTopK)
    with pytest.raises(ValueError, match=r"`block` must be .*got 1$"):
        gradzip.compressor_from_spec("sharedtopk:block=1")
    with pytest.raises(ValueError, match=r"`ratio` must be in \(0, 1\], got 1.5"):
        gradzip.SharedTopK(ratio=1.5)
    with pytest.raises(TypeError, match="`block`"):
        gradzip.SharedTopK(block=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`keep` must be"):
        block_layout([10], 4, [4])


GLOO_SPECS = [SPEC, "sharedtopk:ratio=0.1,block=16"]
for _spec in GLOO_SPECS:
    gloo_parity.register(f"shared_support:{_spec}", gloo_parity.Case(SHAPES, _spec, _grads))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [3, 4])
def test_gloo_processes_match_the_simulator_bit_for_bit(world_size: int) -> None:
    for spec in GLOO_SPECS:
        key = f"shared_support:{spec}"
        sim, sim_results = gloo_parity.simulate(gloo_parity.CASES[key], world_size)
        for rank, real in enumerate(gloo_parity.results(world_size, key)):
            for step in range(3):
                for name in SHAPES:
                    assert torch.equal(sim_results[step][name], real["results"][step][name]), (
                        spec, rank, step, name)
            for key_ in ("payload_bytes", "wire_bytes"):
                assert real["stats"][key_] == [sim.stats[key_][rank]], (spec, key_)
            for name, res in real["residuals"].items():
                assert torch.equal(res, sim.residuals[name][rank]), (spec, rank, name)
