"""The simulator and real gloo processes give the same results and byte counts."""

from __future__ import annotations

import pytest
import torch

import gradzip
import shared_launch
from conformance import DECODE_TOL, SHAPES, SPECS, make_grads

STEPS = 3


def _worker(rank: int, world_size: int, specs: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for spec in specs:
        engine = gradzip.Engine(SHAPES, spec)  # the world process group
        results = []
        for step in range(STEPS):
            grads = {n: g[rank] for n, g in make_grads(world_size, step).items()}
            results.append(engine.reduce(grads))
        out[spec] = {
            "results": results,
            "stats": engine.stats,
            "residuals": {n: r[0] for n, r in engine.residuals.items()},
        }
    return out


def _simulate(spec: str, workers: int) -> tuple[list[dict[str, torch.Tensor]], gradzip.Engine]:
    engine = gradzip.Engine(SHAPES, spec, collective=gradzip.SimulatedGroup(workers))
    return [engine.reduce(make_grads(workers, s)) for s in range(STEPS)], engine


for _world in (2, 4):
    shared_launch.register(_world, "gloo_parity", _worker, SPECS)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_simulator_matches_gloo_processes(
        world_size: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    # Launched with the other modules' workers of this world size (see shared_launch).
    per_rank = shared_launch.results(world_size, "gloo_parity", tmp_path_factory)
    for spec in SPECS:
        sim_results, sim = _simulate(spec, world_size)
        for rank, got in enumerate(per_rank):
            real = got[spec]
            for step in range(STEPS):
                for name in SHAPES:
                    a, b = sim_results[step][name], real["results"][step][name]
                    if world_size == 2:
                        # Two summands: addition order cannot matter, results are bit-equal.
                        assert torch.equal(a, b), (spec, rank, step, name)
                    else:
                        # fp16/bf16 sums round after every addition, so their order shows.
                        tol = DECODE_TOL.get(spec, 1e-5)
                        assert torch.allclose(a, b, atol=tol, rtol=tol), (spec, rank, step, name)
            # Every rank received the same averaged gradient.
            for step in range(STEPS):
                for name in SHAPES:
                    assert torch.equal(real["results"][step][name], per_rank[0][spec]["results"][step][name])
            stats = real["stats"]
            for key in ("payload_bytes", "wire_bytes", "dense_payload_bytes", "dense_wire_bytes"):
                assert stats[key] == [sim.stats[key][rank]], (spec, key)
            for name, res in real["residuals"].items():
                assert torch.allclose(res, sim.residuals[name][rank], atol=1e-5, rtol=1e-4)
