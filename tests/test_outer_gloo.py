"""The outer loop in real gloo processes: periodic averaging, and the simulator's bits
(parameters, counters and the workers' mean)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import gradzip
import shared_launch
from gradzip.comm import run_processes
from outer_helpers import inner_step, make_inner, make_model, params_of, run_rank, run_simulated

STEPS = 9
MODES: list[tuple[int, str, str, dict[str, Any]]] = [
    (STEPS, "none", "sgd", dict(inner_steps=3, outer_optimizer="sgd", outer_lr=1.0)),
    (STEPS, "none", "adamw", dict(inner_steps=3)),  # DiLoCo: Nesterov outer step
    (STEPS, "chunktopk:chunk=32,k=8,bits=2", "sgd", dict(inner_steps=4, fragments=2, delay=1, alpha=0.5,
                                                                   overlap=True)),
    (STEPS, "chunktopk:chunk=32,k=4,average=senders", "adamw", dict(inner_steps=3, outer_optimizer="ef-momentum")),
    (STEPS + 1, "binmean:bits=4", "sgd", dict(inner_steps=3)),  # ends between synchronisations
    (STEPS, "scatterq", "adamw", dict(inner_steps=3, offload=True)),  # INTELLECT-1: 8 bits every hop
]


def _periodic_averaging(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Periodic parameter averaging written with torch.distributed alone: every 3 steps each
    worker subtracts the all-reduced mean of ``anchor - params`` from the anchor."""
    torch.set_num_threads(1)
    model = make_model()
    opt = make_inner(model)
    anchor = params_of(model)
    for step in range(STEPS):
        inner_step(model, opt, step, rank)
        if (step + 1) % 3 == 0:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    delta = anchor[name] - p
                    dist.all_reduce(delta)
                    anchor[name] = anchor[name] - delta / world
                    p.copy_(anchor[name])
    return params_of(model)


def _worker(rank: int, world: int) -> dict[str, Any]:
    return {"outer": run_rank(rank, world, MODES), "reference": _periodic_averaging(rank, world)}


shared_launch.register(2, "outer_gloo", _worker)


@pytest.mark.slow
def test_two_gloo_processes_match_periodic_averaging_and_the_simulator_bit_for_bit(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    # Launched with the other modules' workers of this world size (see shared_launch).
    per_rank = shared_launch.results(2, "outer_gloo", tmp_path_factory)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the worker processes
    try:
        simulated = [run_simulated(2, steps, spec, inner, **kwargs) for steps, spec, inner, kwargs in MODES]
    finally:
        torch.set_num_threads(threads)
    means = [(outer.consensus(), outer.consensus_wire_bytes) for _, outer in simulated]
    for rank, got in enumerate(per_rank):
        # `none` with outer SGD at lr 1 is periodic parameter averaging, bit for bit.
        for name, value in got["reference"].items():
            assert torch.equal(got["outer"][0]["params"][name], value), name
        for mode, (models, outer) in enumerate(simulated):
            real = got["outer"][mode]
            for name, value in models[rank].named_parameters():
                assert torch.equal(real["params"][name], value), (MODES[mode][1], name)
            for key in ("payload_bytes", "wire_bytes", "dense_payload_bytes", "dense_wire_bytes"):
                assert real["stats"][key] == [outer.stats[key][rank]], (MODES[mode][1], key)
            assert real["stats"]["syncs"] == outer.stats["syncs"]
            # The workers' mean, as the simulator gives it, and nothing else changed.
            mean, sent = means[mode]
            assert all(torch.equal(real["consensus"][n], v) for n, v in mean.items()), MODES[mode][1]
            after = dict(real["stats_after"])
            assert after.pop("consensus_wire_bytes") == sent > 0
            assert after == {k: v for k, v in real["stats"].items() if k != "consensus_wire_bytes"}
    # Every worker ends with identical parameters, except where alpha > 0 keeps a share of
    # each worker's own progress or the run ends between synchronisations; the workers' mean
    # is identical everywhere.
    for mode, (steps, _, _, kwargs) in enumerate(MODES):
        apart = kwargs.get("alpha") or steps % kwargs["inner_steps"]
        for key in ("consensus",) if apart else ("params", "consensus"):
            for name, value in per_rank[0]["outer"][mode][key].items():
                assert torch.equal(per_rank[1]["outer"][mode][key][name], value), (mode, key)


def _mismatched(rank: int, world: int) -> int:
    torch.set_num_threads(1)
    model = make_model()
    opt = make_inner(model)
    outer = gradzip.Outer(model, "none", inner_steps=2, outer_lr=0.7 if rank == 0 else 0.5)
    for step in range(2):
        inner_step(model, opt, step, rank)
        outer.step()
    return outer.stats["syncs"]


@pytest.mark.slow
def test_ranks_with_different_outer_configurations_fail_together() -> None:
    results = run_processes(_mismatched, 2, timeout=120, return_exceptions=True)
    for result in results:
        assert isinstance(result, RuntimeError), result
        assert "ranks disagree on `outer_optimizer`" in str(result)
