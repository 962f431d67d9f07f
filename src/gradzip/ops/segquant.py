"""Whole-message helpers of the quantisers: per-segment sums and keyed uniform noise.

A call's tensors are laid end to end in one ``[L, total]`` buffer, and each tensor is cut into
*segments* (QSGD's buckets; one per tensor for Sign). The quantisers' per-segment work (a
norm, a mean magnitude, a per-entry factor) then takes a fixed number of ops per call, not
one op per tensor or per distinct tensor size: an index mapping every entry to its segment,
built once per layout from the shapes alone, turns the reductions into one indexed sum and the
broadcasts back into one gather.

Two properties hold by construction:

* **A segment's results depend on its own entries only**, never on its neighbours in the call
  (so not on how DDP groups tensors into buckets): each sum is accumulated in float64 entry by
  entry in order on the CPU (:func:`segment_sums`), and the noise of an entry is a function of
  its own key and its position within its tensor (:func:`keyed_uniform`).
* **The noise is the same on every device.** :func:`keyed_uniform` is an integer hash (no
  generator and no global RNG): ``u = h(key, position) / 2**24``, computed with exact integer
  ops, so a CPU run, a CUDA run, the host path and the device path, the simulator and a real
  process group all draw the same bits from the same ``(seed, step, name, rank)``, and a
  resumed run draws what the uninterrupted run drew. On the CPU a NumPy form (32-bit words
  that wrap, several times faster than torch's 64-bit shifts) gives the same bits as the
  torch form other devices run.

On CUDA, :func:`segment_sums` adds with float64 atomics whose order may vary between runs; a
float64 sum that differs in its last bits rounds to the same float32 except at a rounding tie,
so results are reproducible run to run except in such rare ties (under
``torch.use_deterministic_algorithms(True)`` PyTorch uses a deterministic kernel instead).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from gradzip.ops.branches import cpu_form
from gradzip.ops.flat import cat_rows, pack, to_device
from gradzip.ops.random import stable_hash

__all__ = [
    "UNIT", "SegmentLayout", "join_rows", "key32", "keyed_draws", "keyed_uniform",
    "segment_layout", "segment_sums",
]

_MASK = 0xFFFFFFFF
# The two multipliers of the 32-bit finaliser: odd and below 2**31, so that a 32-bit word
# times one of them stays below 2**63 in torch's int64 (no signed overflow anywhere).
_M1, _M2 = 0x21F0AAAD, 0x735A2D97
#: Uniform draws take the top 24 bits of the hash: exact in float32 after scaling by this.
UNIT = 2.0**-24


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: layouts are cached
class SegmentLayout:
    """How a call's entries map to tensors and segments.

    Attributes:
        numels: entries of each tensor, in call order.
        segments: segments in the call (each tensor's, in order).
        segment: ``[total]`` int32: each entry's segment (the same tensor as ``owner``
            where every segment is a whole tensor).
        owner: ``[total]`` int32: each entry's tensor.
        position: ``[total]`` int32, on the host: each entry's index within its tensor.
        lengths: ``[segments]`` float64: each segment's entry count (at least 1).
        per_tensor: segments of each tensor.
    """

    numels: tuple[int, ...]
    segments: int
    segment: torch.Tensor
    owner: torch.Tensor
    position: torch.Tensor
    lengths: torch.Tensor
    per_tensor: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.numels)

    def on(self, device: torch.device) -> SegmentLayout:
        """This layout with its tensors on ``device`` (cached per layout and device)."""
        return _layout_on(self, str(torch.device(device)))


def _segment_length(numel: int, segment_size: int) -> int:
    """Entries per segment of a tensor of ``numel`` entries (at least 1)."""
    return max(1, numel if segment_size == 0 else min(segment_size, numel))


@lru_cache(maxsize=64)
def _host_layout(numels: tuple[int, ...], segment_size: int) -> SegmentLayout:
    counts = np.asarray(numels, dtype=np.int64)
    size = np.asarray([_segment_length(n, segment_size) for n in numels], dtype=np.int64)
    per_tensor = -(-counts // size)  # 0 for an empty tensor
    first = np.concatenate([[0], np.cumsum(per_tensor)[:-1]]).astype(np.int64)
    owner = np.repeat(np.arange(len(numels), dtype=np.int64), counts)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    position = np.arange(counts.sum(), dtype=np.int64) - np.repeat(starts, counts)
    segment = first[owner] + position // size[owner] if owner.size else owner
    lengths = np.minimum(size.repeat(per_tensor),
                         np.repeat(counts, per_tensor) - _local_starts(per_tensor, size))
    # int32 indices (index_select and index_add_ take them): half the memory of int64, and
    # one tensor serves as both where every segment is a whole tensor.
    owner_t = torch.from_numpy(owner.astype(np.int32))
    segment_t = owner_t if np.array_equal(segment, owner) else torch.from_numpy(segment.astype(np.int32))
    return SegmentLayout(
        numels, int(per_tensor.sum()), segment_t, owner_t,
        torch.from_numpy(position.astype(np.int32)),
        torch.from_numpy(np.maximum(lengths, 1).astype(np.float64)),
        tuple(int(p) for p in per_tensor),
    )


def _local_starts(per_tensor: np.ndarray, size: np.ndarray) -> np.ndarray:
    """First entry, within its tensor, of every segment."""
    within = np.arange(per_tensor.sum(), dtype=np.int64) - np.repeat(
        np.concatenate([[0], np.cumsum(per_tensor)[:-1]]), per_tensor)
    return within * size.repeat(per_tensor)


@lru_cache(maxsize=64)
def _layout_on(layout: SegmentLayout, device: str) -> SegmentLayout:
    owner = to_device(layout.owner, device)
    segment = owner if layout.segment is layout.owner else to_device(layout.segment, device)
    # Positions stay on the host: only the draws read them, through their hashed copy.
    return SegmentLayout(layout.numels, layout.segments, segment, owner, layout.position,
                         to_device(layout.lengths, device), layout.per_tensor)


def segment_layout(
    numels: Sequence[int], segment_size: int = 0, device: torch.device | str = "cpu"
) -> SegmentLayout:
    """The layout of tensors of ``numels`` entries laid end to end, each cut into segments of
    ``segment_size`` entries (the last one shorter; 0: one segment per tensor; an empty tensor
    has none). Built from the sizes only, once per layout and device (cached: treat it as
    read-only).

    Args:
        numels: entries of each tensor (at least one tensor).
        segment_size: entries per segment, or 0.
        device: where the index tensors live.

    Returns:
        The :class:`SegmentLayout`.

    Raises:
        ValueError: no tensor, a negative size or a negative ``segment_size``.
    """
    numels = tuple(int(n) for n in numels)
    if not numels or min(numels) < 0:
        raise ValueError(f"`numels` must be a non-empty sequence of sizes >= 0, got {numels}")
    if int(segment_size) < 0:
        raise ValueError(f"`segment_size` must be >= 0, got {segment_size}")
    return _host_layout(numels, int(segment_size)).on(torch.device(device))


def segment_sums(values: torch.Tensor, index: torch.Tensor, count: int) -> torch.Tensor:
    """Per-segment float64 sums of every row.

    Each row is one indexed add into float64 (the squares and magnitudes of float32 values
    lose nothing on the way in); on the CPU the entries of a segment are added in order, so a
    segment's sum depends on its own entries only.

    Args:
        values: ``[L, total]``.
        index: ``[total]`` int32 or int64, each in ``[0, count)`` (a layout's ``segment`` or
            ``owner``).
        count: the number of segments.

    Returns:
        ``[L, count]`` float64: the sum of the entries of each segment (0 where it has none).
    """
    rows = values.shape[0]
    wide = values.to(torch.float64)
    out = torch.zeros(rows, count, dtype=torch.float64, device=values.device)
    for row in range(rows):  # one indexed add per local worker (1 in a process group)
        out[row].index_add_(0, index, wide[row])
    return out


def join_rows(tensors: Sequence[torch.Tensor], rows: int) -> torch.Tensor:
    """A call's tensors side by side.

    Args:
        tensors: at least one ``[rows, ...]`` tensor, all of one dtype and device.
        rows: the length of their first axis (the local workers).

    Returns:
        ``[rows, total]``: with one row, where the tensors already lie one after another in
        one storage (a bucket's views), a view of it (no op; never written to here);
        otherwise one concatenation (a new tensor).
    """
    if rows == 1:  # pack views them where they tile one buffer, else concatenates them
        return pack(tensors)[None]
    return cat_rows(tensors, rows)


def key32(*keys: object) -> int:
    """A 32-bit key derived from ``keys``.

    Args:
        *keys: values with a stable ``repr`` (:func:`~gradzip.ops.random.stable_hash`).

    Returns:
        An integer in ``[0, 2**32)``, the same on every process.
    """
    return stable_hash(*keys) & _MASK


def _hash_torch(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit finaliser on int64 words holding 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK
    return x ^ (x >> 15)


def _hash_numpy(x: np.ndarray) -> np.ndarray:
    """:func:`_hash_torch` on uint32 words (products wrap modulo 2**32: the same bits)."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(_M1)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(_M2)
    return x ^ (x >> np.uint32(15))


@lru_cache(maxsize=64)
def _mixed_positions_host(position: torch.Tensor) -> np.ndarray:
    """Each position hashed once (independent of the keys), uint32: cached per layout."""
    return _hash_numpy(position.numpy().astype(np.uint32) ^ np.uint32(0x9E3779B9))


@lru_cache(maxsize=64)
def _mixed_positions(position: torch.Tensor, device: str) -> torch.Tensor:
    """:func:`_mixed_positions_host` on ``device``, its 32 bits held in int32 (half the
    memory of int64; the hash masks them back to unsigned)."""
    return to_device(torch.from_numpy(_mixed_positions_host(position).view(np.int32)), device)


def keyed_draws(keys: Sequence[Sequence[int]], layout: SegmentLayout,
                device: torch.device | str) -> torch.Tensor:
    """``[L, total]`` integer draws, uniform in ``[0, 2**24)``: entry ``i`` of tensor ``t`` in
    row ``r`` draws ``h(keys[r][t], i)``, a hash of its tensor's key (:func:`key32`) and its
    position in its tensor, so a draw depends neither on the other tensors of the call nor on
    the device. ``draws * UNIT`` are uniform floats in ``[0, 1)`` (exact in float32); a
    consumer may fold that product into its next op (``torch.add(x, draws, alpha=UNIT)``).
    The values are held in int64 (the torch form, whose add casts them on the fly) or, in
    the CPU's NumPy form, in float32 (exact below ``2**24``; no cast left for the add): the
    same numbers either way.

    Args:
        keys: ``[L][T]`` 32-bit keys, one per row and tensor of ``layout``.
        layout: the call's layout (:func:`segment_layout`).
        device: where the draws are made.

    Returns:
        The draws, on ``device``.

    Raises:
        ValueError: ``keys`` is not one row of one key per tensor of ``layout``.
    """
    device = torch.device(device)
    rows = [[int(k) & _MASK for k in row] for row in keys]
    if not rows or any(len(row) != len(layout.numels) for row in rows):
        raise ValueError(f"`keys` must hold rows of {len(layout.numels)} keys (one per tensor), "
                         f"got {[len(row) for row in rows]}")
    if cpu_form(device):
        mixed = _mixed_positions_host(layout.position)
        counts = np.asarray(layout.numels, dtype=np.int64)
        out = np.empty((len(rows), mixed.shape[0]), dtype=np.float32)
        for r, row in enumerate(rows):
            words = mixed ^ np.repeat(np.asarray(row, dtype=np.uint32), counts)
            out[r] = _hash_numpy(words) >> np.uint32(8)
        return torch.from_numpy(out)
    here = layout.on(device)
    key_rows = to_device(torch.tensor(rows, dtype=torch.int64), device)  # queued, no host wait
    mixed = _mixed_positions(here.position, str(device))
    # int32 ^ int64 sign-extends the int32 word: the mask keeps its 32 bits, unsigned.
    words = (mixed ^ key_rows.index_select(1, here.owner)) & _MASK
    return _hash_torch(words) >> 8


def keyed_uniform(keys: Sequence[Sequence[int]], layout: SegmentLayout,
                  device: torch.device | str) -> torch.Tensor:
    """:func:`keyed_draws` as float32 in ``[0, 1)`` (multiples of ``2**-24``).

    Args:
        keys: ``[L][T]`` 32-bit keys, one per row and tensor of ``layout``.
        layout: the call's layout (:func:`segment_layout`).
        device: where the draws are made.

    Returns:
        The draws, on ``device``.
    """
    return keyed_draws(keys, layout, device).to(torch.float32) * UNIT
