"""Finiteness tests and checkpoint validation for the engine's state.

Kept apart from :mod:`gradzip.engine` so the step logic stays readable: everything here is a
pure function of tensors and plain data (the finiteness tests of tensors themselves are in
:mod:`gradzip.ops.finite`, where compressors use them too).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Integral, Real
from typing import Any

import torch

from gradzip.ops.finite import all_finite

__all__ = ["check_tree", "copy_tree", "first_nonfinite", "nonneg_int", "snapshot_tree"]


def copy_tree(tree: Any) -> Any:
    """Copy the dict and list structure of a state tree, sharing its tensors (state is
    replaced, never mutated in place, so a shared tensor never changes under a copy)."""
    if isinstance(tree, dict):
        # Leaves are shared without a call each: a controller's state holds a few values per
        # tensor, and the engine copies the tree at the start of every step.
        return {k: copy_tree(v) if isinstance(v, (dict, list)) else v for k, v in tree.items()}
    if isinstance(tree, list):
        return [copy_tree(v) if isinstance(v, (dict, list)) else v for v in tree]
    return tree


def snapshot_tree(tree: Any) -> Any:
    """:func:`copy_tree` for the engine's restore point at every step: the dicts copied, the
    lists shared whole, with their items.

    Why: state dicts are changed by assigning their keys, so a restore point needs its own
    dicts; but a list in state is replaced, never changed in place, and neither are its
    items (the controllers' decision logs are rebuilt when they grow, their records written
    before they are logged; ``tests/test_conformance.py`` checks every compressor and
    controller for it), so sharing a list is as safe as sharing a tensor. And a controller's
    log holds a record per tensor and decision point (about 500 for ResNet-18 under
    Accordion): copying them cost about a millisecond of host time at every step.
    """
    if isinstance(tree, dict):
        return {k: snapshot_tree(v) if isinstance(v, dict) else v for k, v in tree.items()}
    return tree


def _leaves(tree: Any, path: str, before: Any, out: list[tuple[str, Any]]) -> None:
    if tree is before and before is not None and not isinstance(tree, (dict, list)):
        return
    if isinstance(tree, dict):
        old = before if isinstance(before, dict) else {}
        for key, value in tree.items():
            _leaves(value, f"{path}.{key}", old.get(key), out)
    elif (isinstance(tree, torch.Tensor) and tree.is_floating_point()) or isinstance(tree, float):
        out.append((path, tree))


def first_nonfinite(tree: Any, path: str, before: Any = None) -> str | None:
    """The path of the first float or float tensor in ``tree`` holding NaN or Inf.

    Lists are not searched: in compressor state they hold logs (Accordion's decision
    records), read by people, never by the algorithm, and walking them on every call would
    cost more than the test of the tensors.

    Args:
        tree: nested dicts/lists of tensors and plain values.
        path: the name of ``tree`` in messages.
        before: the same tree before a step; leaves that are the very same objects as there
            were checked already and are skipped (state is replaced, never mutated in place).

    All tensors are tested together (one host read); the path is looked up only when one
    of them is not finite.
    """
    leaves: list[tuple[str, Any]] = []
    _leaves(tree, path, before, leaves)
    for where, value in leaves:
        if isinstance(value, float) and not math.isfinite(value):
            return where
    tensors = [(where, t) for where, t in leaves if isinstance(t, torch.Tensor)]
    if all_finite([t for _, t in tensors]):
        return None
    return next(where for where, t in tensors if not all_finite([t]))


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
