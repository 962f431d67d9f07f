"""The outer loop's failure handling in real gloo processes: a skipped synchronisation, an
overlapped exchange beside the user's own collectives, and ranks configured differently."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import gradzip
import shared_launch
from gradzip.comm import run_processes
from outer_helpers import batch, make_model, params_of

STEPS = 12
POISON = {(2, 1)}  # (inner step, worker): that worker's loss turns NaN
CASES: list[dict[str, Any]] = [
    dict(inner_steps=2),
    dict(inner_steps=4, fragments=2, delay=1, overlap=True),
]


def _inner(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> torch.Tensor:
    x, y = batch(step, rank)
    loss = (model(x) - y).pow(2).mean()
    if (step, rank) in POISON:
        loss = loss * float("nan")
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _momentum(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _rank(rank: int, world: int) -> list[dict[str, Any]]:
    """Every case on this worker, the user's loop issuing a loss all-reduce and a barrier at
    every inner step (beside an overlapped exchange, where there is one)."""
    torch.set_num_threads(1)
    out = []
    for kwargs in CASES:
        model = make_model()
        opt = _momentum(model)
        outer = gradzip.Outer(model, "topk:ratio=0.3", inner_optimizers=[opt], **kwargs)
        for step in range(STEPS):
            loss = _inner(model, opt, step, rank)
            dist.all_reduce(loss)
            dist.barrier()
            outer.step()
        out.append({"params": params_of(model), "stats": outer.stats})
    return out


def _simulated(kwargs: dict[str, Any]) -> tuple[list[torch.nn.Module], gradzip.Outer]:
    models = [make_model() for _ in range(2)]
    opts = [_momentum(m) for m in models]
    outer = gradzip.Outer(models, "topk:ratio=0.3", collective=gradzip.SimulatedGroup(2),
                          inner_optimizers=opts, **kwargs)
    for step in range(STEPS):
        for rank, (m, o) in enumerate(zip(models, opts, strict=True)):
            _inner(m, o, step, rank)
        outer.step()
    return models, outer


shared_launch.register(2, "outer_gloo_recovery", _rank, timeout=180)


@pytest.mark.slow
def test_a_skipped_sync_and_user_collectives_match_the_simulator_bit_for_bit(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    # Launched with the other modules' workers of this world size (see shared_launch).
    per_rank = shared_launch.results(2, "outer_gloo_recovery", tmp_path_factory)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the worker processes
    try:
        simulated = [_simulated(kwargs) for kwargs in CASES]
    finally:
        torch.set_num_threads(threads)
    for case, (models, outer) in enumerate(simulated):
        assert outer.stats["skipped_syncs"] == 1
        for rank, got in enumerate(per_rank):
            real = got[case]
            assert real["stats"]["skipped_syncs"] == 1 and real["stats"]["syncs"] == outer.stats["syncs"]
            assert real["stats"]["wire_bytes"] == [outer.stats["wire_bytes"][rank]]
            for name, value in models[rank].named_parameters():
                assert torch.equal(real["params"][name], value), (case, name)
                assert bool(torch.isfinite(value).all())


def _differing(rank: int, world: int, option: str) -> int:
    torch.set_num_threads(1)
    model = make_model()
    if option == "engine_decide_on":
        engine = gradzip.Engine(model, "topk:ratio=0.3", decide_on="host" if rank == 0 else "device")
        engine.reduce({n: torch.zeros_like(p) for n, p in model.named_parameters()})
        return engine.step
    kwargs: dict[str, Any] = dict(inner_steps=4, fragments=2, delay=1)
    kwargs[option] = {"overlap": (True, False), "decide_on": ("host", "device"),
                      "max_skipped_syncs": (3, 4)}[option][rank]
    outer = gradzip.Outer(model, "topk:ratio=0.3", **kwargs)
    return outer.syncs


DIFFERING = [("engine_decide_on", "decide_on"), ("overlap", "overlap"),
             ("decide_on", "decide_on"), ("max_skipped_syncs", "max_skipped_syncs")]


def _each_differing(rank: int, world: int, options: list[str]) -> list[str]:
    """Every option's refusal in one set of processes (starting them costs more than the
    cases; the handshake refuses on every rank alike, so the collectives stay paired)."""
    out = []
    for option in options:
        try:
            _differing(rank, world, option)
            out.append("no error")
        except Exception as err:  # noqa: BLE001 - the message is what is tested
            out.append(f"{type(err).__name__}: {err}")
    return out


@pytest.fixture(scope="module")
def differing() -> list[list[str]]:
    """``differing[rank][case]``, the cases in :data:`DIFFERING`'s order."""
    return run_processes(_each_differing, 2, [o for o, _ in DIFFERING], timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(DIFFERING)), ids=[o for o, _ in DIFFERING])
def test_ranks_that_differ_fail_together_naming_the_option(differing, case) -> None:
    field = DIFFERING[case][1]
    for per_rank in differing:
        assert per_rank[case] != "no error", per_rank
        assert f"ranks disagree on `{field}`" in per_rank[case], per_rank[case]
