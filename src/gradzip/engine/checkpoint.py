"""The engine's checkpoints: its state as plain data, and an all-or-nothing load.

:meth:`~gradzip.Engine.state_dict` and :meth:`~gradzip.Engine.load_state_dict` call these; the
validation itself lives in :mod:`gradzip.checkpoint`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gradzip.checkpoint import validate_checkpoint
from gradzip.engine.base import EngineBase
from gradzip.engine.step import Step
from gradzip.options import MAIN_ROUTE
from gradzip.statecheck import copy_tree

__all__ = ["FORMAT_VERSION", "checkpoint_config", "load_state", "save_state"]

FORMAT_VERSION = 1


def save_state(engine: EngineBase) -> dict[str, Any]:
    """:meth:`~gradzip.Engine.state_dict`: everything needed to resume exactly: tensors and plain values only.

    Residuals belong to the workers of this process: save one file per rank.

    Raises:
        RuntimeError: called inside a step.
    """
    if engine._step.begun:
        raise RuntimeError("state_dict() must be called between steps, not inside one")
    return {
        **checkpoint_config(engine),
        "parameters": {n: list(s) for n, s in engine.shapes.items()},
        "step": engine.step,
        "skipped_steps": engine.skipped_steps,
        "residual_scale": engine.residual_scale,
        "residuals": {n: r.clone() for n, r in engine.residuals.items()},
        "without_residual": sorted(engine._feedback - set(engine.residuals)),
        "compressor_state": copy_tree(engine.compressor_state),
        "rule_states": copy_tree(engine.rule_states),
        "meter": engine.comm.meter.snapshot(),
        "dense_payload": list(engine.dense_payload),
        "dense_wire": list(engine.dense_wire),
    }


def checkpoint_config(engine: EngineBase) -> dict[str, Any]:
    """The configuration a checkpoint records and a load must match, field by field."""
    return {
        "format_version": FORMAT_VERSION,
        "compressor": engine.compressor.spec(),
        "error_feedback": engine.error_feedback,
        "dense_1d": engine.dense_1d,
        "rules": engine._rule_specs(),
        "min_numel": engine.options.min_numel,
        "world_size": engine.comm.world_size,
        "ranks": list(engine.comm.local_ranks),
    }


def load_state(engine: EngineBase, state: Mapping[str, Any]) -> None:
    """:meth:`~gradzip.Engine.load_state_dict`: restore :meth:`state_dict` output: validate all of it, then swap it in at once.

    A checkpoint holding NaN or Inf anywhere is refused (it would poison every later
    step); so is one from another parameter set, in either direction. When this raises,
    the engine is unchanged.

    Raises:
        TypeError: ``state`` is not a mapping.
        ValueError: a missing key (named), another format version, compressor, rules,
            world size, rank or parameter set, a negative or fractional counter, a wrong shape or
            dtype, or a non-finite value (the first problem is named).
    """
    loaded = validate_checkpoint(
        state,
        config=checkpoint_config(engine),
        shapes=engine.shapes,
        dense_names=engine.dense_names,
        feedback_names=engine._feedback,
        workers=engine.comm.local_workers,
        fresh_state=engine._router.fresh_state(MAIN_ROUTE, engine.comm),
        fresh_rule_states=engine._router.fresh_rule_states(engine.comm),
        router=engine._router,
    )
    # Everything is valid: swap it in.
    engine.step, engine.skipped_steps = loaded.step, loaded.skipped_steps
    engine.residual_scale = loaded.residual_scale
    engine.residuals = loaded.residuals
    engine.compressor_state = copy_tree(loaded.compressor_state)
    engine.rule_states = copy_tree(loaded.rule_states)
    engine.comm.meter.load(loaded.meter)
    engine.dense_payload, engine.dense_wire = loaded.dense_payload, loaded.dense_wire
    engine._step = Step()  # whatever step was in progress is forgotten
