"""Finiteness tests and checkpoint validation for the engine's state.

Kept apart from :mod:`gradzip.engine` so the step logic stays readable: everything here is a
pure function of tensors and plain data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from numbers import Integral, Real
from typing import Any

import torch

__all__ = ["all_finite", "bad_workers", "check_tree", "first_nonfinite", "nonneg_int"]

_HALF = (torch.float16, torch.bfloat16)


def _sums(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack([
        r.sum(dim=-1, dtype=torch.float32 if r.dtype in _HALF else None).float() for r in rows
    ], dim=-1)


def bad_workers(tensors: Sequence[torch.Tensor], workers: int) -> list[bool]:
    """Per local worker, whether any of ``tensors`` (each ``[L, ...]``) holds NaN or Inf.

    A sum is finite whenever every entry is (NaN and Inf propagate through it), so one summing
    pass per tensor clears the usual case, much faster than an elementwise test; a sum that is
    not finite (a NaN or Inf entry, or finite entries whose sum overflows) is settled by the
    exact elementwise test.
    """
    bad = [False] * workers
    if not tensors:
        return bad
    rows = [t.reshape(workers, -1) for t in tensors]
    sums = _sums(rows)  # [L, T]
    for w, t in torch.nonzero(~torch.isfinite(sums)).tolist():
        if not bad[w] and not bool(torch.isfinite(rows[t][w]).all()):
            bad[w] = True
    return bad


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every entry of every tensor is finite (the same two-stage test)."""
    if not tensors:
        return True
    rows = [t.reshape(-1) for t in tensors]
    sums = _sums(rows)
    for t in torch.nonzero(~torch.isfinite(sums)).reshape(-1).tolist():
        if not bool(torch.isfinite(rows[t]).all()):
            return False
    return True


def first_nonfinite(tree: Any, path: str, before: Any = None) -> str | None:
    """The path of the first float or float tensor in ``tree`` holding NaN or Inf.

    Args:
        tree: nested dicts/lists of tensors and plain values.
        path: the name of ``tree`` in messages.
        before: the same tree before a step; leaves that are the very same objects as there
            were checked already and are skipped (state is replaced, never mutated in place).
    """
    if tree is before and before is not None and not isinstance(tree, (dict, list)):
        return None
    if isinstance(tree, dict):
        old = before if isinstance(before, dict) else {}
        for key, value in tree.items():
            found = first_nonfinite(value, f"{path}.{key}", old.get(key))
            if found:
                return found
        return None
    if isinstance(tree, list):
        for i, value in enumerate(tree):
            found = first_nonfinite(value, f"{path}[{i}]")
            if found:
                return found
        return None
    if isinstance(tree, torch.Tensor):
        if tree.is_floating_point() and not all_finite([tree]):
            return path
        return None
    if isinstance(tree, float) and not math.isfinite(tree):
        return path
    return None


def nonneg_int(value: Any) -> bool:
    """Whether ``value`` is an integer (not a bool) >= 0."""
    return isinstance(value, Integral) and not isinstance(value, bool) and int(value) >= 0


def check_tree(expected: Any, got: Any, path: str) -> str | None:
    """Describe the first difference between a fresh state tree and a loaded one.

    Compared: dict keys, tensor shapes and dtypes, and the kind of plain values (a number
    where a number is expected, a bool where a bool, a string where a string). Where the fresh
    tree holds ``None`` or a list (values that fill in as training goes), any plain value is
    accepted. Every float and float tensor must be finite.
    """
    if isinstance(expected, dict):
        if not isinstance(got, Mapping):
            return f"{path}: expected a dict, got {type(got).__name__}"
        missing = [str(k) for k in expected if k not in got]
        extra = [str(k) for k in got if k not in expected]
        if missing or extra:
            return f"{path}: missing keys {sorted(missing)}, unexpected keys {sorted(extra)}"
        for key in expected:
            found = check_tree(expected[key], got[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{path}: expected a tensor, got {type(got).__name__}"
        if expected.shape != got.shape:
            return f"{path}: expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
        if expected.dtype != got.dtype:
            return f"{path}: expected dtype {expected.dtype}, got {got.dtype}"
        if got.is_floating_point() and not all_finite([got]):
            return f"{path}: holds NaN or Inf"
        return None
    if isinstance(expected, bool):
        return None if isinstance(got, bool) else f"{path}: expected a bool, got {got!r}"
    if isinstance(expected, Real):
        if isinstance(got, bool) or not isinstance(got, Real):
            return f"{path}: expected a number, got {got!r}"
        if isinstance(expected, Integral) and not isinstance(got, Integral):
            return f"{path}: expected an integer, got {got!r}"
        if not math.isfinite(float(got)):
            return f"{path}: holds NaN or Inf"
        return None
    if isinstance(expected, str):
        return None if isinstance(got, str) else f"{path}: expected a string, got {got!r}"
    found = first_nonfinite(got, path)
    return f"{found}: holds NaN or Inf" if found else None
