"""Non-finite decisions kept on the device: flags, masked results and rollbacks by ``where``.

On CUDA every host read of a device value (``.item()``, ``bool(t)``, ``.tolist()``) makes the
host wait for the GPU, which stalls the stream that launches kernels. For compressors whose
collectives' sizes depend on the shapes only (``Compressor.device_decisions``), the engine
need not know *during* a call whether it was non-finite: it keeps the answer as a 0-d bool
tensor and applies the policy with ``torch.where`` (results masked, residuals and state
restored), which gives, bit for bit, what the host decision gives. Counters fold in on the
device and are read when someone reads them.

Everything here is a pure function of tensors and trees of tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gradzip.ops.finite import extremes_test, finite_rows

__all__ = ["any_nonfinite", "changed_tensors", "finite_rows_at_once", "nonfinite_flag",
           "where_tree"]


def finite_rows_at_once(tensors: Sequence[torch.Tensor], workers: int) -> torch.Tensor:
    """:func:`~gradzip.ops.finite.finite_rows` over one concatenation of the tensors: ``[L]``
    bool, no host read, a few ops per call instead of a few per tensor.

    Why: on CUDA every op is a kernel launch, and a call holds tens of tensors, mostly small;
    one copy of their entries costs less than one launch per tensor. The answer is the same
    (a concatenation keeps every value; floating dtypes are promoted without changing
    whether a value is finite).
    """
    filled = [t for t in tensors if t.numel()]
    if len(filled) <= 1:
        return finite_rows(tensors, workers)
    return finite_rows([torch.cat([t.reshape(workers, -1) for t in filled], dim=1)], workers)


def nonfinite_flag(x: torch.Tensor) -> torch.Tensor:
    """0-d bool: whether any entry of ``x`` (not empty) is NaN or Inf, in one pass over ``x``
    and four ops on two numbers (no host read; see
    :func:`~gradzip.ops.finite.extremes_test`)."""
    return extremes_test(x).ne(0)


def any_nonfinite(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """0-d bool on ``device``: whether any entry of any tensor is NaN or Inf (no host read;
    one pass over the tensors' concatenation, see :func:`finite_rows_at_once`)."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.zeros((), dtype=torch.bool, device=device)
    if len(tensors) == 1:
        return nonfinite_flag(tensors[0])
    return nonfinite_flag(torch.cat([t.reshape(-1) for t in tensors]))


def changed_tensors(tree: Any, before: Any) -> list[torch.Tensor] | None:
    """The tensor leaves of ``tree`` that are not the very objects of ``before`` (state is
    replaced, never mutated in place); ``None`` where ``tree`` changed in a way a device
    rollback cannot undo (a new or removed key, a plain value that changed, a tensor whose
    shape or dtype changed)."""
    out: list[torch.Tensor] = []

    def walk(new: Any, old: Any) -> bool:
        if new is old:
            return True
        if isinstance(new, dict):
            if not isinstance(old, dict) or new.keys() != old.keys():
                return False
            return all(walk(new[k], old[k]) for k in new)
        if isinstance(new, torch.Tensor):
            if not (isinstance(old, torch.Tensor) and old.shape == new.shape
                    and old.dtype == new.dtype and old.device == new.device):
                return False
            if new.is_floating_point():
                out.append(new)
            return True
        try:
            return bool(new == old)
        except (RuntimeError, TypeError):  # tensors inside lists: not undoable here
            return False

    return out if walk(tree, before) else None


def where_tree(flag: torch.Tensor, before: Any, after: Any) -> Any:
    """``before`` where ``flag`` holds, else ``after``, leaf by leaf (trees that
    :func:`changed_tensors` accepted; leaves that are the same object are shared)."""
    if after is before:
        return after
    if isinstance(after, dict):
        return {k: where_tree(flag, before[k], v) for k, v in after.items()}
    if isinstance(after, torch.Tensor):
        return torch.where(flag, before, after)
    return after
