"""The engine's checkpoints: :meth:`state_dict` and an all-or-nothing :meth:`load_state_dict`.

A mixin of :class:`~gradzip.Engine`; the validation itself lives in :mod:`gradzip.checkpoint`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gradzip.checkpoint import validate_checkpoint
from gradzip.statecheck import copy_tree

__all__ = ["FORMAT_VERSION", "EngineCheckpoints"]

FORMAT_VERSION = 1


class EngineCheckpoints:
    """Checkpoints of :class:`~gradzip.Engine` (a mixin; see the module docstring)."""

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly: tensors and plain values only.

        Residuals belong to the workers of this process: save one file per rank.
        """
        if self._snapshot is not None:
            raise RuntimeError("state_dict() must be called between steps, not inside one")
        return {
            **self._checkpoint_config(),
            "parameters": {n: list(s) for n, s in self.shapes.items()},
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "residual_scale": self.residual_scale,
            "residuals": {n: r.clone() for n, r in self.residuals.items()},
            "without_residual": sorted(self._feedback - set(self.residuals)),
            "compressor_state": copy_tree(self.compressor_state),
            "rule_states": copy_tree(self.rule_states),
            "meter": self.comm.meter.snapshot(),
            "dense_payload": list(self.dense_payload),
            "dense_wire": list(self.dense_wire),
        }

    def _checkpoint_config(self) -> dict[str, Any]:
        """The configuration a checkpoint records and a load must match, field by field."""
        return {
            "format_version": FORMAT_VERSION,
            "compressor": self.compressor.spec(),
            "error_feedback": self.error_feedback,
            "dense_1d": self.dense_1d,
            "rules": self._rule_specs(),
            "min_numel": self.options.min_numel,
            "world_size": self.comm.world_size,
            "ranks": list(self.comm.local_ranks),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output: validate all of it, then swap it in at once.

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
            config=self._checkpoint_config(),
            shapes=self.shapes,
            dense_names=self.dense_names,
            feedback_names=self._feedback,
            workers=self.comm.local_workers,
            fresh_state=self.compressor.init_state(self._compressed_shapes()),
            fresh_rule_states=self._router.fresh_rule_states(),
            router=self._router,
        )
        # Everything is valid: swap it in.
        self.step, self.skipped_steps = loaded.step, loaded.skipped_steps
        self.residual_scale = loaded.residual_scale
        self.residuals = loaded.residuals
        self.compressor_state = copy_tree(loaded.compressor_state)
        self.rule_states = copy_tree(loaded.rule_states)
        self.comm.meter.load(loaded.meter)
        self.dense_payload, self.dense_wire = loaded.dense_payload, loaded.dense_wire
        self._reset_step()
