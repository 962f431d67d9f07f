"""Selection over a whole message of tensors laid end to end, in a fixed number of ops.

A call holds tens of tensors of many sizes. Selecting in each tensor apart costs a few launches
per tensor (or per distinct size) on a GPU; here the call's tensors are *segments* of one flat
row, and one selection covers them all:

* :func:`segmented_topk` ranks every entry by one int64 key, its segment in the high word and
  its magnitude's bits (a non-negative float's bits order as the float does) in the low word,
  so one stable sort groups the entries by segment, each segment by descending magnitude
  (ties: the lower position first), and segment ``i``'s ``k_i`` largest sit at positions of
  the sorted row known from the shapes alone. No count is read on the host.
* :func:`strided_random` draws ``k_i`` distinct positions in each segment, one in each of
  ``k_i`` strides, from a counter-based hash of a per-segment key and the stride's number:
  a few integer ops over the ``K`` picks, keyed so that every worker, every backend and a
  resumed run draw the same positions, whatever segments share the call.

Each segment's result depends on its own entries (and key) only, never on its neighbours, so
it does not change with how a caller groups tensors into calls. Layouts are cached per shape
list and device: treat their tensors as read-only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from gradzip.ops.flat import to_device

__all__ = [
    "SegmentLayout", "in_segments", "pieces", "segment_keys", "segment_layout",
    "segmented_topk", "strided_random",
]

#: Flat positions travel as int32: a layout over more entries is refused.
MAX_ENTRIES = 2**31 - 1
# Multipliers of the hash (odd 64-bit constants, as signed int64: torch has no uint64 math).
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


@dataclass(frozen=True)
class SegmentLayout:
    """The shape-only tensors of a selection of ``picks[i]`` entries in each of the segments
    of ``sizes[i]`` entries laid end to end (on one device).

    Attributes:
        sizes: entries per segment.
        picks: entries selected per segment (``1 <= picks[i] <= sizes[i]``).
        base: ``[N]`` int64, each entry's segment number times ``2**32`` (the sort key's high word).
        ranks: ``[K]`` int64, the positions of the sorted row that hold each segment's first
            ``picks[i]`` entries, segment after segment.
        bounds: ``[T + 1]`` int32, the segments' first positions, then ``N``.
        owner: ``[K]`` int32, ``i + 1`` for each of segment ``i``'s picks (what
            ``bucketize(position, bounds, right=True)`` gives for a position inside it).
        stride_start: ``[K]`` int64, the first position of each pick's stride.
        stride_len: ``[K]`` int64, each pick's stride's length.
        key_of: ``[K]`` int64, each pick's segment number.
        counter: ``[K]`` int64, a constant of each pick's stride number (for the hash).
    """

    sizes: tuple[int, ...]
    picks: tuple[int, ...]
    base: torch.Tensor
    ranks: torch.Tensor
    bounds: torch.Tensor
    owner: torch.Tensor
    stride_start: torch.Tensor
    stride_len: torch.Tensor
    key_of: torch.Tensor
    counter: torch.Tensor

    @property
    def total(self) -> int:
        """Entries of all segments."""
        return int(sum(self.sizes))

    @property
    def selected(self) -> int:
        """Entries selected in all segments."""
        return int(sum(self.picks))

    def starts(self) -> list[int]:
        """Each segment's first position, then the total."""
        out = [0]
        for n in self.sizes:
            out.append(out[-1] + n)
        return out


@lru_cache(maxsize=64)
def _layout(sizes: tuple[int, ...], picks: tuple[int, ...], device: str) -> SegmentLayout:
    sizes_t = torch.tensor(sizes, dtype=torch.int64)
    picks_t = torch.tensor(picks, dtype=torch.int64)
    segs = torch.arange(len(sizes), dtype=torch.int64)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), sizes_t.cumsum(0)])
    base = (segs << 32).repeat_interleave(sizes_t)
    owner_seg = segs.repeat_interleave(picks_t)
    first_pick = torch.cat([torch.zeros(1, dtype=torch.int64), picks_t.cumsum(0)[:-1]])
    within = torch.arange(int(picks_t.sum()), dtype=torch.int64) - first_pick.repeat_interleave(picks_t)
    ranks = starts[:-1].repeat_interleave(picks_t) + within
    # Stride j of a segment of n entries with k picks: [floor(j n / k), floor((j + 1) n / k)),
    # so the k strides tile the segment and each holds floor(n / k) or ceil(n / k) entries.
    n_of, k_of = sizes_t.repeat_interleave(picks_t), picks_t.repeat_interleave(picks_t)
    lo, hi = within * n_of // k_of, (within + 1) * n_of // k_of
    tensors = {
        "base": base, "ranks": ranks, "bounds": starts.to(torch.int32),
        "owner": (owner_seg + 1).to(torch.int32), "stride_start": starts[:-1].repeat_interleave(picks_t) + lo,
        "stride_len": hi - lo, "key_of": owner_seg, "counter": _counters(within),
    }
    return SegmentLayout(sizes, picks, **{k: to_device(v, device) for k, v in tensors.items()})


def _counters(within: torch.Tensor) -> torch.Tensor:
    """``(j * golden) * mix1`` modulo ``2**64`` for each stride number ``j`` (int64
    multiplication wraps modulo ``2**64``)."""
    return within * _signed(_GOLDEN * _MIX1)


def segment_layout(sizes: Sequence[int], picks: Sequence[int], device: torch.device | str) -> SegmentLayout:
    """The layout of selecting ``picks[i]`` entries in each segment of ``sizes[i]`` entries
    (cached per arguments; treat its tensors as read-only).

    Raises:
        ValueError: no segment, lengths differ, a pick count outside ``[1, size]``, or more
            than :data:`MAX_ENTRIES` entries in all.
    """
    sizes, picks = tuple(int(s) for s in sizes), tuple(int(k) for k in picks)
    if not sizes or len(sizes) != len(picks):
        raise ValueError(f"`sizes` and `picks` must be non-empty and of equal length, got "
                         f"{len(sizes)} and {len(picks)}")
    for n, k in zip(sizes, picks, strict=True):
        if not 1 <= k <= n:
            raise ValueError(f"each of `picks` must be in [1, its segment's size], got {k} for size {n}")
    if sum(sizes) > MAX_ENTRIES:
        raise ValueError(f"`sizes` must total at most {MAX_ENTRIES} entries, got {sum(sizes)}")
    return _layout(sizes, picks, str(torch.device(device)))


def pieces(sizes: Sequence[int], most: int = MAX_ENTRIES) -> list[tuple[int, int]]:
    """``(start, stop)`` index ranges that split ``sizes`` in order into runs of at most
    ``most`` entries in all (a single size above ``most`` is a run of its own): how calls
    too large for int32 flat positions are cut. One pass (the running total is kept, not
    summed again per tensor)."""
    out: list[tuple[int, int]] = []
    start, entries = 0, 0
    for i, n in enumerate(sizes):
        if i > start and entries + n > most:
            out.append((start, i))
            start, entries = i, 0
        entries += n
    if len(sizes) > start:
        out.append((start, len(sizes)))
    return out


def segmented_topk(flat: torch.Tensor, layout: SegmentLayout) -> torch.Tensor:
    """Each segment's ``picks[i]`` largest-magnitude entries, for every row of ``flat``.

    Args:
        flat: ``[L, N]`` float32, the segments laid end to end in every row.
        layout: from :func:`segment_layout` (on ``flat``'s device).

    Returns:
        ``[L, K]`` int64 positions in the row, segment after segment, each segment's by
        descending magnitude; among equal magnitudes the lower position first. NaN ranks
        above every number (as in ``torch.topk``). Four ops whatever the number of segments.

    Raises:
        ValueError: ``flat`` is not a 2-D float32 tensor of ``layout``'s width.
    """
    if flat.dim() != 2 or flat.dtype != torch.float32 or flat.shape[1] != layout.total:
        raise ValueError(f"`flat` must be float32 [L, {layout.total}], got {flat.dtype} "
                         f"{tuple(flat.shape)}")
    # A non-negative float32's bits, read as int32, order as the float does (NaN above inf).
    bits = flat.abs().view(torch.int32)
    key = layout.base - bits  # segment ascending, then magnitude descending
    order = torch.sort(key, dim=1, stable=True).indices
    return order.index_select(1, layout.ranks)


def in_segments(positions: torch.Tensor, layout: SegmentLayout) -> torch.Tensor:
    """0-d bool: whether every row of ``positions[R, K]`` (integer flat positions, as
    :func:`segmented_topk` or :func:`strided_random` lay them out) holds each segment's picks
    inside that segment. No host read."""
    where = torch.bucketize(positions, layout.bounds, right=True, out_int32=True)
    return where.eq(layout.owner).all()


def segment_keys(keys: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """``[T]`` int64 on ``device``: the per-segment keys :func:`strided_random` takes, from
    any integers (e.g. stable hashes of a seed, a step and a tensor's name).

    Each key is multiplied by the hash's first constant here, on the host, so the device
    does one multiplication fewer per draw.
    """
    mixed = [_signed(int(k) * _MIX1) for k in keys]
    # Made on the host every call (the keys change with the step): queued from page-locked
    # memory, since a plain copy to a GPU would make the host wait for it.
    return to_device(torch.tensor(mixed, dtype=torch.int64), device)


def _signed(v: int) -> int:
    """``v`` modulo ``2**64`` as a signed 64-bit integer."""
    return ((v % 2**64) ^ 2**63) - 2**63


def strided_random(keys: torch.Tensor, layout: SegmentLayout) -> torch.Tensor:
    """``picks[i]`` distinct positions in each segment ``i``: one uniformly drawn in each of
    ``picks[i]`` strides that tile the segment (strides of ``floor(n / k)`` or
    ``ceil(n / k)`` entries), so each entry is drawn with probability ``1 / len(stride)``,
    ``k / n`` where ``k`` divides ``n``.

    The draw is a 64-bit multiply-xorshift hash of the segment's key and the stride's number
    (integer ops only, exact everywhere): every device and backend draws the same positions
    from the same keys, and a segment's draw does not depend on the other segments.

    Args:
        keys: ``[T]`` int64 from :func:`segment_keys` (on the layout's device).
        layout: from :func:`segment_layout`.

    Returns:
        ``[K]`` int64 flat positions, segment after segment, ascending within each.

    Raises:
        ValueError: ``keys`` is not ``[T]`` int64.
    """
    if keys.dtype != torch.int64 or keys.shape != (len(layout.sizes),):
        raise ValueError(f"`keys` must be int64 of shape ({len(layout.sizes)},), got {keys.dtype} "
                         f"{tuple(keys.shape)}")
    # (key + stride * golden) * mix1, modulo 2**64 (both terms premultiplied).
    x = keys.index_select(0, layout.key_of) + layout.counter
    x = (x ^ (x >> 31)) * _MIX2
    # The high 32 bits spread over the stride (remainder is non-negative for a positive
    # divisor; the bias is below 2**-20 for strides under 4096 entries).
    return layout.stride_start + (x >> 32) % layout.stride_len
