"""A skipped synchronisation: every worker continues from the anchor; a run whose
synchronisations keep being skipped stops."""

from __future__ import annotations

import logging

import pytest
import torch

import gradzip
from outer_helpers import make_inner, make_model


def _momentum_sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _run(inner: str, steps: int, poison: set[tuple[int, int]], *, give_optimizers: bool = True,
         **kwargs):
    """``steps`` inner steps of two simulated workers; at each ``(step, worker)`` in
    ``poison`` that worker's gradient turns NaN before its inner optimizer steps (so its
    optimizer state is poisoned too)."""
    models = [make_model() for _ in range(2)]
    opts = [_momentum_sgd(m) if inner == "momentum" else make_inner(m, inner) for m in models]
    kwargs.setdefault("inner_steps", 2)
    outer = gradzip.Outer(models, "topk:ratio=0.3", collective=gradzip.SimulatedGroup(2),
                          inner_optimizers=opts if give_optimizers else None, **kwargs)
    anchors = []
    for step in range(steps):
        for rank, (m, o) in enumerate(zip(models, opts, strict=True)):
            x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1000 * step + rank))
            loss = (m(x) - torch.sin(x[:, :3])).pow(2).mean()
            if (step, rank) in poison:
                loss = loss * float("nan")
            loss.backward()
            o.step()
            o.zero_grad()
        outer.step()
        anchors.append({n: t.clone() for n, t in outer.anchor.items()})
    return models, opts, outer, anchors


@pytest.mark.parametrize(("inner", "kwargs"), [
    ("momentum", {}),
    ("adamw", {}),
    ("sgd", dict(inner_steps=4, fragments=2)),
    ("adamw", dict(inner_steps=4, fragments=2, delay=1)),
    ("momentum", dict(alpha=0.5)),
])
def test_one_nan_inner_step_on_one_worker_does_not_stop_outer_training(inner, kwargs) -> None:
    models, _, outer, anchors = _run(inner, 16, {(2, 1)}, **kwargs)
    stats = outer.stats
    assert stats["skipped_syncs"] == 1, stats
    assert stats["syncs"] == 16 // (outer.plan.period)
    # The anchor moved at the last synchronisation, and everything is finite.
    assert any(not torch.equal(anchors[-1][n], anchors[-5][n]) for n in outer.names)
    for m in models:
        assert all(bool(torch.isfinite(p).all()) for p in m.parameters())
    assert all(bool(torch.isfinite(t).all()) for t in outer.anchor.values())


def test_a_skipped_sync_returns_every_tensor_to_the_anchor_and_clears_the_inner_optimizers() -> None:
    # Fragments of H=4, P=2: fragment 1 is sent after step 4 (0-based 3); the NaN at 0-based
    # step 2 poisons every tensor of worker 0, fragment 0's among them.
    models, opts, outer, _ = _run("adamw", 4, {(2, 0)}, inner_steps=4, fragments=2)
    assert outer.stats["skipped_syncs"] == 1
    for m in models:
        for name, p in m.named_parameters():
            assert torch.equal(p, outer.anchor[name]), name  # every fragment's tensor
    assert all(not o.state for o in opts)


def test_skipped_syncs_in_a_row_stop_the_run_on_every_worker() -> None:
    poison = {(s, 0) for s in range(40)}  # worker 0 is non-finite at every step
    with pytest.raises(FloatingPointError, match=r"3 synchronisations in a row were skipped") as info:
        _run("momentum", 40, poison)
    assert "\n" not in str(info.value)
    with pytest.raises(FloatingPointError, match="1 synchronisations in a row"):
        _run("momentum", 40, poison, max_skipped_syncs=1)
    # Skips that are not in a row do not add up.
    _, _, outer, _ = _run("momentum", 24, {(1, 0), (5, 1), (9, 0), (13, 1)}, max_skipped_syncs=2)
    assert outer.stats["skipped_syncs"] == 4


def test_the_stop_leaves_every_worker_at_the_anchor_with_the_step_counted() -> None:
    models = [make_model() for _ in range(2)]
    outer = gradzip.Outer(models, "none", inner_steps=1, collective=gradzip.SimulatedGroup(2),
                          max_skipped_syncs=1)
    anchor = {n: t.clone() for n, t in outer.anchor.items()}
    with torch.no_grad():
        next(models[0].parameters()).fill_(float("nan"))
    with pytest.raises(FloatingPointError):
        outer.step()
    assert outer.inner_step == 1 and outer.consecutive_skips == 1
    for m in models:
        for name, p in m.named_parameters():
            assert torch.equal(p, anchor[name])


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_max_skipped_syncs_is_validated(value) -> None:
    with pytest.raises((TypeError, ValueError), match="`max_skipped_syncs` must be"):
        gradzip.Outer([make_model() for _ in range(2)], "none", inner_steps=2,
                      collective=gradzip.SimulatedGroup(2), max_skipped_syncs=value)


def test_without_inner_optimizers_a_skip_says_it_cannot_clear_them(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="gradzip.outer.outer"):
        _run("momentum", 4, {(1, 0)}, give_optimizers=False)
    assert any("holds no inner optimizers to reset" in r.getMessage() for r in caplog.records)


def test_a_resumed_run_continues_the_count_of_skips_in_a_row() -> None:
    _, _, outer, _ = _run("momentum", 4, {(1, 0), (3, 0)}, max_skipped_syncs=5)
    state = outer.state_dict()
    assert state["consecutive_skips"] == 2
    models = [make_model() for _ in range(2)]
    fresh = gradzip.Outer(models, "topk:ratio=0.3", inner_steps=2, collective=gradzip.SimulatedGroup(2),
                          inner_optimizers=[_momentum_sgd(m) for m in models])
    fresh.load_state_dict(state)
    assert fresh.consecutive_skips == 2 and fresh.skipped_syncs == 2
