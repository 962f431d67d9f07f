"""Ranks out of step, in real gloo processes with the engine used directly in a plain loop: a
tensor missing on one rank, a rank that skips a call or a step. Each must raise a clear error
on every rank (before any collective of mismatched size, which would abort the process), and
leave engines whose ``state_dict()`` still works. Non-finite decisions are taken alike on
every rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gradzip
import shared_launch
from conformance import SHAPES, make_grads

OUT_OF_STEP = "ranks are out of step"


def _mine(rank: int, world: int, step: int) -> dict[str, torch.Tensor]:
    return {n: g[rank] for n, g in make_grads(world, step).items()}


def _outcome(fn: Any) -> str:
    try:
        fn()
    except (RuntimeError, FloatingPointError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def _missing_tensor(rank: int, world: int, specs: list[str]) -> list[dict[str, Any]]:
    results = []
    for spec in specs:
        engine = gradzip.Engine(SHAPES, spec)

        def loop(engine: gradzip.Engine = engine) -> None:
            for step in range(4):
                grads = _mine(rank, world, step)
                if rank == 1 and step == 2:
                    del grads["fc.weight"]  # this rank lost a tensor for one step
                engine.reduce(grads)

        message = _outcome(loop)
        results.append({"message": message, "step": engine.state_dict()["step"]})
    return results


def _skipped_step(rank: int, world: int) -> str:
    engine = gradzip.Engine(SHAPES, "topk:ratio=0.05")

    def loop() -> None:
        for step in range(4):
            if rank == 1 and step == 1:
                continue  # this rank skips a whole step of the loop
            engine.reduce(_mine(rank, world, step), step=step)

    return _outcome(loop)


def _skipped_call(rank: int, world: int) -> str:
    engine = gradzip.Engine(SHAPES, "powersgd:rank=2")
    names = list(SHAPES)

    def loop() -> None:
        for step in range(3):
            grads = _mine(rank, world, step)
            parts = [names[:2], names[2:3], names[3:]]
            if rank == 0 and step == 1:
                parts = [parts[0], parts[2]]  # one call of the step is missing on this rank
            for i, part in enumerate(parts):
                engine.reduce({n: grads[n] for n in part}, finish_step=i == len(parts) - 1)

    message = _outcome(loop)
    engine.state_dict()  # still works
    return message


def _model_loop(rank: int, world: int) -> list[str]:
    """Engine built from a module, ``reduce_`` in a plain training loop; one rank skips a step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = gradzip.Engine(model, "powersgd:rank=1", optimizer=optimizer)
    gen = torch.Generator().manual_seed(rank)
    seen = []

    def loop() -> None:
        for step in range(5):
            x = torch.randn(4, 6, generator=gen)
            if rank == 0 and step == 2:
                continue
            optimizer.zero_grad()
            model(x).square().mean().backward()
            engine.reduce_(step=step)
            optimizer.step()
            seen.append("ok")

    seen.append(_outcome(loop))
    return seen


def _nonfinite_on_one_rank(rank: int, world: int) -> list[Any]:
    """The policy is applied on every rank alike, with and without state, and for an
    overflow that only one rank's compression produces."""
    results: list[Any] = []
    for spec, policy in (("none", "raise"), ("qsgd", "raise"), ("topk:ratio=0.05", "skip")):
        engine = gradzip.Engine(SHAPES, spec, nonfinite=policy)
        grads = _mine(rank, world, 0)
        if rank == 1:
            grads["conv.bias"][3] = float("nan")
        try:
            out = engine.reduce(grads)
            results.append(("returned", all(bool(torch.isnan(v).all()) for v in out.values()),
                            engine.stats["skipped_steps"]))
        except FloatingPointError:
            results.append(("raised", engine.state_dict()["step"]))
    engine = gradzip.Engine(SHAPES, "sign")
    grads = _mine(rank, world, 0)
    if rank == 0:
        grads["fc.weight"] = torch.full_like(grads["fc.weight"], 3e38)  # twice the scale overflows
    out = engine.reduce(grads)
    results.append(("sign", all(bool(torch.isnan(v).all()) for v in out.values()),
                    engine.stats["skipped_steps"]))
    out = engine.reduce(_mine(rank, world, 1))
    results.append(("after", all(bool(torch.isfinite(v).all()) for v in out.values())))
    return results


MISSING_SPECS = ["none", "topk:ratio=0.05", "threshold:budget=0.05"]


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    """Every scenario above in one set of processes (starting them costs more than the
    scenarios; each fails on every rank at the same call, so the collectives stay paired)."""
    return {"missing": _missing_tensor(rank, world, MISSING_SPECS),
            "skipped_step": _skipped_step(rank, world),
            "skipped_call": _skipped_call(rank, world),
            "model_loop": _model_loop(rank, world),
            "nonfinite": _nonfinite_on_one_rank(rank, world)}


shared_launch.register(2, "desync", _scenarios)


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    """``scenarios[name][rank]``."""
    # Launched with the other modules' workers of this world size (see shared_launch).
    per_rank = shared_launch.results(2, "desync", tmp_path_factory)
    return {name: [ranks[name] for ranks in per_rank] for name in per_rank[0]}


@pytest.mark.slow
def test_a_tensor_missing_on_one_rank_raises_on_every_rank(scenarios: dict[str, list[Any]]) -> None:
    """Without the header, gloo aborts the process ("Received data size doesn't match")."""
    for per_rank in scenarios["missing"]:
        for result in per_rank:
            assert result["message"].startswith(f"RuntimeError: {OUT_OF_STEP}"), result
            assert "call 0 of step 2" in result["message"]
            assert result["step"] == 2  # the step was abandoned; the engine still checkpoints


@pytest.mark.slow
def test_rank_desynchronisation_is_caught_on_every_rank(scenarios: dict[str, list[Any]]) -> None:
    for message in scenarios["skipped_step"]:
        assert message.startswith(f"RuntimeError: {OUT_OF_STEP}"), message
    for message in scenarios["skipped_call"]:
        assert message.startswith(f"RuntimeError: {OUT_OF_STEP}") and "step 1" in message, message
    for seen in scenarios["model_loop"]:
        assert seen[:2] == ["ok", "ok"] and seen[-1].startswith(f"RuntimeError: {OUT_OF_STEP}"), seen


@pytest.mark.slow
def test_nonfinite_decisions_agree_across_real_ranks(scenarios: dict[str, list[Any]]) -> None:
    first, second = scenarios["nonfinite"]
    assert first == second
    assert first[0] == ("raised", 0) and first[1] == ("raised", 0)
    assert first[2] == ("returned", True, 1)
    assert first[3] == ("sign", True, 1) and first[4] == ("after", True)


def test_the_header_sum_detects_any_disagreement() -> None:
    """``W * sum(c ** 2) == sum(c) ** 2`` exactly when all codes are equal, for any codes of
    24 bits and up to 32768 workers (no int64 overflow)."""
    from gradzip.comm.header import make_header, read_header

    top = (1 << 24) - 1
    for codes in ([5, 5, 5], [top] * 4, [0, 0], [1, 2], [top, top - 1, top], [0, top]):
        total = sum(make_header(c, [False])[0] for c in codes)
        agreed, nonfinite = read_header(total, len(codes))
        assert agreed == (len(set(codes)) == 1) and not nonfinite, codes
    total = make_header(top, [True])[0] * 32768
    assert read_header(total, 32768) == (True, True)
