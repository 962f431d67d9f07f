"""Engines in real gloo processes against the simulator, for the test modules that register
cases here: every case registered runs in one launch of processes per world size (starting
them costs more than the cases), the first time a test asks for that size; at the sizes the
registering modules ask for (:data:`SHARED_WORLDS`), the launch other modules' workers share
(``shared_launch``).

A case is plain data and module-level functions, so it pickles into the spawned processes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

import gradzip
import shared_launch
from gradzip.comm import run_processes

__all__ = ["Case", "register", "results", "simulate"]


@dataclass(frozen=True)
class Case:
    """One engine configuration run for a few steps.

    Attributes:
        shapes: the engine's tensors.
        spec: the compressor spec.
        grads: ``(workers, step) -> {name: [workers, ...]}``, every worker's gradients.
        steps: how many steps.
        same_layout: passed to every ``reduce``.
        probe: ``(engine, workers) -> value`` read on every rank after the steps (what must
            be decided alike everywhere), or ``None``.
    """

    shapes: Mapping[str, torch.Size]
    spec: str
    grads: Callable[[int, int], dict[str, torch.Tensor]]
    steps: int = 3
    same_layout: bool = False
    probe: Callable[[Any, int], Any] | None = field(default=None)


CASES: dict[str, Case] = {}
_RUNS: dict[int, dict[str, list[dict[str, Any]]]] = {}


def register(key: str, case: Case) -> None:
    """Add ``case`` under ``key`` (a module registers at import, before any test runs)."""
    if CASES.get(key, case) != case:
        raise ValueError(f"`key` {key!r} is registered with another case")
    CASES[key] = case


def _run(rank: int, world: int, case: Case) -> dict[str, Any]:
    engine = gradzip.Engine(case.shapes, case.spec)  # the world process group
    got = [engine.reduce({n: g[rank] for n, g in case.grads(world, step).items()},
                         same_layout=case.same_layout) for step in range(case.steps)]
    state = engine.compressor_state
    owner = state.get("owner", {}) if isinstance(state, dict) else {}
    return {"results": got, "stats": engine.stats,
            "residuals": {n: r[0] for n, r in engine.residuals.items()},
            "owner": {n: o[0] for n, o in owner.items()},
            "probe": None if case.probe is None else case.probe(engine, world)}


def _worker(rank: int, world: int, cases: dict[str, Case]) -> dict[str, dict[str, Any]]:
    return {key: _run(rank, world, case) for key, case in cases.items()}


#: The world sizes the registering modules ask for.
SHARED_WORLDS = (3, 4)
for _world in SHARED_WORLDS:
    # CASES itself: the cases registered by the time the launch runs (every module registers
    # at import, before any test runs).
    shared_launch.register(_world, "gloo_parity_cases", _worker, CASES, timeout=480)


def results(world: int, key: str) -> list[dict[str, Any]]:
    """Case ``key``'s outcome on every rank of ``world`` gloo processes, in rank order:
    ``results`` (each step's), ``stats``, ``residuals`` and ``owner`` (this rank's rows) and
    ``probe``. Every registered case not run yet at this size runs now, in one launch."""
    done = _RUNS.setdefault(world, {})
    if world in SHARED_WORLDS and not done:
        per_rank = shared_launch.results(world, "gloo_parity_cases")
        for k in per_rank[0]:
            done[k] = [ranks[k] for ranks in per_rank]
    missing = {k: c for k, c in CASES.items() if k not in done}
    if missing:
        per_rank = run_processes(_worker, world, missing, timeout=240 + 20 * len(missing))
        for k in missing:
            done[k] = [ranks[k] for ranks in per_rank]
    return done[key]


def simulate(case: Case, world: int) -> tuple[gradzip.Engine, list[dict[str, torch.Tensor]]]:
    """The same case in the simulator: its engine after the steps, and each step's results."""
    engine = gradzip.Engine(case.shapes, case.spec, collective=gradzip.SimulatedGroup(world))
    got = [engine.reduce(case.grads(world, step), same_layout=case.same_layout)
           for step in range(case.steps)]
    return engine, got
