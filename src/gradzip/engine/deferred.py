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
from gradzip.ops.flat import cat_flat, cat_rows, pack, to_device, unpack_like

__all__ = ["any_nonfinite", "changed_tensors", "finite_rows_at_once", "memory_runs",
           "nonfinite_flag", "nonfinite_rows_at_once", "where_many", "where_tree"]


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
    return finite_rows([cat_rows(filled, workers)], workers)


def nonfinite_rows_at_once(tensors: Sequence[torch.Tensor], workers: int) -> torch.Tensor:
    """``[L]`` bool: the negation of :func:`finite_rows_at_once` (whether worker ``w``'s part
    of any tensor holds NaN or Inf), one op fewer where there is one row."""
    filled = [t for t in tensors if t.numel()]
    if workers == 1 and filled:
        return _nonfinite_by_dtype(filled).reshape(1)
    return ~finite_rows_at_once(tensors, workers)


def _nonfinite_by_dtype(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """0-d bool: whether any entry of the (non-empty) ``tensors`` is NaN or Inf, one pass
    over one concatenation per dtype.

    Why per dtype: a concatenation of mixed dtypes promotes every entry (float32 residuals
    next to a compressor's float64 counters become float64), which copies each tensor
    separately (one launch per tensor on a GPU) instead of once in one ``cat``. Each group's
    extremes test is exact in its own dtype (a largest magnitude or a minimum and maximum
    never overflow), and NaN plus anything is NaN, so adding the groups' tests (promoted in
    the one ``add``) gives the same answer as the test of the promoted concatenation.
    """
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    if len(groups) == 1:
        whole = tensors[0] if len(tensors) == 1 else cat_flat(tensors)
        return nonfinite_flag(whole)
    total: torch.Tensor | None = None
    for dtype, group in groups.items():
        if not (dtype.is_floating_point or dtype.is_complex):
            continue  # integers and bools are finite (the promoted test passed them too)
        whole = group[0] if len(group) == 1 else cat_flat(group)
        test = extremes_test(whole)
        total = test if total is None else total + test
    if total is None:
        return torch.zeros((), dtype=torch.bool, device=tensors[0].device)
    return total.ne(0)


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
    return _nonfinite_by_dtype(tensors)


def changed_tensors(tree: Any, before: Any) -> list[torch.Tensor] | None:
    """The tensor leaves of ``tree`` that are not the very objects of ``before`` (state is
    replaced, never mutated in place); ``None`` where ``tree`` changed in a way a device
    rollback cannot undo (a new or removed key, a plain value that changed, a tensor whose
    shape or dtype changed). A tensor that moved to another device is undone by moving the
    old one there (:func:`where_many`): state made before the device was known (the sharded
    exchange's owner residuals, PowerSGD's first ``Q``) moves at its first call."""
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
                    and old.dtype == new.dtype):
                return False
            if new.is_floating_point():
                out.append(new)
            return True
        try:
            return bool(new == old)
        except (RuntimeError, TypeError):  # tensors inside lists: not undoable here
            return False

    return out if walk(tree, before) else None


def where_many(
    flag: torch.Tensor, before: Sequence[torch.Tensor], after: Sequence[torch.Tensor],
    *, in_place: bool = False,
) -> list[torch.Tensor]:
    """``torch.where(flag, b, a)`` for each pair, elementwise the same, in one ``where`` per
    buffer: the ``after`` tensors are grouped by the storage they live in (a call's flat
    buffer of residuals or warm starts, see :func:`~gradzip.ops.flat.pack`), and each group
    is decided at once (one launch on a GPU instead of one per tensor).

    Args:
        flag: 0-d bool.
        before, after: pairs of tensors of equal shapes and dtypes.
        in_place: write the choice into the ``after`` tensors where a group tiles one buffer
            (they are returned themselves), for callers that own them and replace them by
            the result anyway. Why: the new buffer's views cost a Python object per tensor
            (a microsecond or more each), the write costs nothing more than the ``where``.
            The caller must hold the only references that matter: the engine's rollback of
            the residuals a step made (fresh tensors; a compressor replaces its residuals,
            never writes into older ones) is the one such caller.

    Returns:
        The chosen tensors, in order (views of one new buffer per group; with ``in_place``,
        the ``after`` tensors of each group that tiles a buffer).
    """
    out: list[torch.Tensor | None] = [None] * len(after)
    groups = memory_runs(after)
    if groups is None:
        # Views of one buffer in another order than their memory's (a row laid out in an
        # order of its own, see gradzip.engine.segments): the same runs, found in address
        # order (an address is a plain integer; a storage is a Python object per tensor).
        order = sorted(range(len(after)), key=lambda i: after[i].data_ptr())
        runs = memory_runs([after[i] for i in order])
        if runs is not None:
            groups = [[order[j] for j in run] for run in runs]
    if groups is None:
        by_storage: dict[tuple[int, torch.dtype], list[int]] = {}
        for i, a in enumerate(after):
            by_storage.setdefault((a.untyped_storage().data_ptr(), a.dtype), []).append(i)
        groups = list(by_storage.values())
        for members in groups:
            # In storage order: the members of a buffer made at once (a call's residuals, a
            # compressor's flat state) then tile it, and pack views it without a copy.
            members.sort(key=lambda i: after[i].storage_offset())
    for members in groups:
        now = [after[i] for i in members]
        # The old values where the new ones are (a queued copy; only a step that moved
        # state made elsewhere pays it). A group's old values need not share a device: state
        # made on the host moves to the GPU piece by piece, at the call that first uses it,
        # and a later call may lay pieces of both kinds out in one new buffer.
        device = now[0].device
        olds = [before[i] for i in members]
        if any(o.device != device for o in olds):
            olds = [to_device(o, device) for o in olds]
        old = pack(olds)
        whole = pack(now)
        # A view (they tile a buffer) of memory apart from the old values' (a write into
        # memory the old values share would change them).
        if (in_place and whole.data_ptr() == now[0].data_ptr()
                and whole.untyped_storage().data_ptr() != old.untyped_storage().data_ptr()):
            torch.where(flag, old, whole, out=whole)
            for i in members:
                out[i] = after[i]
            continue
        kept = torch.where(flag, old, whole)
        for i, view in zip(members, unpack_like(kept, now), strict=True):
            out[i] = view
    return [t for t in out if t is not None]


def memory_runs(tensors: Sequence[torch.Tensor], most: int = 4) -> list[list[int]] | None:
    """The positions of ``tensors`` in runs whose entries lie one after another in memory
    (the steady state of a call's residuals: one run per buffer, in order), or ``None`` where
    there would be more than ``most`` runs.

    Why: a few address reads find the buffers without asking each tensor for its storage
    and sorting. Any grouping gives the same values (:func:`~gradzip.ops.flat.pack` copies a
    group that does not tile its memory after all); this one only avoids the work."""
    runs: list[list[int]] = []
    end, dtype = -1, None
    for i, t in enumerate(tensors):
        address = t.data_ptr()
        if address != end or t.dtype != dtype:
            if len(runs) == most:
                return None
            runs.append([])
            dtype = t.dtype
        runs[-1].append(i)
        end = address + t.numel() * t.element_size()
    return runs


def where_tree(flag: torch.Tensor, before: Any, after: Any) -> Any:
    """``before`` where ``flag`` holds, else ``after``, leaf by leaf (trees that
    :func:`changed_tensors` accepted; leaves that are the same object are shared; the changed
    tensor leaves decided together by :func:`where_many`)."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def collect(old: Any, new: Any) -> None:
        if new is old:
            return
        if isinstance(new, dict):
            for k, v in new.items():
                collect(old[k], v)
        elif isinstance(new, torch.Tensor):
            pairs.append((old, new))

    collect(before, after)
    if not pairs:
        return after
    chosen = dict(zip((id(new) for _, new in pairs),
                      where_many(flag, [old for old, _ in pairs], [new for _, new in pairs]),
                      strict=True))

    def build(old: Any, new: Any) -> Any:
        if new is old:
            return new
        if isinstance(new, dict):
            return {k: build(old[k], v) for k, v in new.items()}
        if isinstance(new, torch.Tensor):
            return chosen[id(new)]
        return new

    return build(before, after)
