"""Blocks of a call's tensors: per-block scores, the top blocks of every tensor, their entries.

A call's tensors are laid end to end in one ``[L, total]`` row per local worker, and each tensor
is cut into blocks of ``block`` consecutive entries (its last block shorter where ``block`` does
not divide it). The shared-support exchange (:class:`~gradzip.compressors.shared.SharedTopK`)
scores every block on every worker, sums the scores over the group and sends the entries of each
tensor's best blocks; everything here is pure and a function of the shapes, the block size and
the values given:

* a block's score depends on its own entries only (float64 sums taken entry by entry in order
  on the CPU, :func:`~gradzip.ops.segquant.segment_sums`), never on its neighbours in the call
  nor on how many workers a process holds;
* the blocks chosen are the same for the same scores on every device: ties go to the lower
  block (two stable sorts), and a non-finite score ranks first (NaN above infinity).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from gradzip.ops.flat import to_device
from gradzip.ops.segquant import segment_layout, segment_sums

__all__ = ["BlockLayout", "block_layout", "block_positions", "block_scores", "top_blocks"]


@dataclass(frozen=True, eq=False)  # compared by identity: layouts are cached
class BlockLayout:
    """How a call's entries fall into blocks, and how many blocks each tensor sends.

    Attributes:
        numels: entries of each tensor, in call order.
        block: entries per block.
        blocks: blocks of each tensor (``ceil(n / block)``).
        keep: blocks each tensor sends (at most its blocks).
        owner: ``[S]`` int64: each block's tensor (``S`` blocks in the call).
        starts: ``[S]`` int64: each block's first entry in the call's row.
        ends: ``[S]`` int64: one past each block's last entry.
        take: ``[sum(keep)]`` int64: where each tensor's chosen blocks lie among the call's
            blocks sorted by (tensor, score): its first ``keep`` places.
    """

    numels: tuple[int, ...]
    block: int
    blocks: tuple[int, ...]
    keep: tuple[int, ...]
    owner: torch.Tensor
    starts: torch.Tensor
    ends: torch.Tensor
    take: torch.Tensor

    @property
    def total(self) -> int:
        """Entries in the call."""
        return sum(self.numels)

    @property
    def segments(self) -> int:
        """Blocks in the call."""
        return sum(self.blocks)

    @property
    def sent(self) -> int:
        """Entries one worker's message carries: ``block`` per chosen block (a shorter last
        block padded with zeros, so the size depends on shapes only)."""
        return self.block * sum(self.keep)

    def on(self, device: torch.device | str) -> BlockLayout:
        """This layout with its tensors on ``device`` (cached per layout and device)."""
        return _layout_on(self, str(torch.device(device)))


@lru_cache(maxsize=64)
def _host_layout(numels: tuple[int, ...], block: int, keep: tuple[int, ...]) -> BlockLayout:
    counts = np.asarray(numels, dtype=np.int64)
    blocks = -(-counts // block)
    owner = np.repeat(np.arange(len(numels), dtype=np.int64), blocks)
    first_entry = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    first_block = np.concatenate([[0], np.cumsum(blocks)[:-1]]).astype(np.int64)
    within = np.arange(int(blocks.sum()), dtype=np.int64) - first_block[owner]
    starts = first_entry[owner] + within * block
    ends = np.minimum(starts + block, first_entry[owner] + counts[owner])
    take = np.concatenate([first_block[t] + np.arange(k, dtype=np.int64)
                           for t, k in enumerate(keep)] or [np.zeros(0, dtype=np.int64)])
    return BlockLayout(numels, block, tuple(int(b) for b in blocks), keep,
                       torch.from_numpy(owner), torch.from_numpy(starts), torch.from_numpy(ends),
                       torch.from_numpy(take))


@lru_cache(maxsize=64)
def _layout_on(layout: BlockLayout, device: str) -> BlockLayout:
    return BlockLayout(layout.numels, layout.block, layout.blocks, layout.keep,
                       to_device(layout.owner, device), to_device(layout.starts, device),
                       to_device(layout.ends, device), to_device(layout.take, device))


def block_layout(numels: Sequence[int], block: int, keep: Sequence[int],
                 device: torch.device | str = "cpu") -> BlockLayout:
    """The layout of tensors of ``numels`` entries cut into blocks of ``block``, tensor ``t``
    sending ``keep[t]`` blocks (built from the sizes only, once per layout and device, cached:
    treat it as read-only).

    Args:
        numels: entries of each tensor (at least one tensor, each at least one entry).
        block: entries per block (>= 1).
        keep: blocks each tensor sends, in ``[0, ceil(numel / block)]``.
        device: where its index tensors live.

    Raises:
        ValueError: sizes out of range or of different lengths.
    """
    numels, keep = tuple(int(n) for n in numels), tuple(int(k) for k in keep)
    if not numels or min(numels) < 1 or len(keep) != len(numels):
        raise ValueError(f"`numels` must be sizes >= 1, one per entry of `keep`, got {numels} "
                         f"and {keep}")
    if int(block) < 1:
        raise ValueError(f"`block` must be >= 1, got {block}")
    if any(not 0 <= k <= -(-n // block) for n, k in zip(numels, keep, strict=True)):
        raise ValueError(f"`keep` must be in [0, blocks of each tensor], got {keep} for "
                         f"{numels} in blocks of {block}")
    return _host_layout(numels, int(block), keep).on(device)


def block_scores(flat: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """``[L, S]`` float32: the sum of squares of every block of every row of ``flat[L, total]``
    (squares and sums in float64, one rounding to float32 at the end)."""
    segments = segment_layout(layout.numels, layout.block, flat.device)
    wide = flat.to(torch.float64).square()
    return segment_sums(wide, segments.segment, segments.segments).to(torch.float32)


def top_blocks(scores: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """The chosen blocks of every tensor, ``[sum(keep)]`` int64 indices among the call's blocks:
    each tensor's ``keep`` best by ``scores[S]`` (the highest first; ties to the lower block;
    NaN and infinity first). ``layout`` lies where ``scores`` does (:meth:`BlockLayout.on`)."""
    # Stable both times: the first sort orders the call's blocks by score (equal scores keep
    # their block order), the second groups them by tensor keeping that order, so each tensor's
    # blocks come best first, ties to the lower block, whatever the other tensors hold.
    by_score = torch.sort(scores, descending=True, stable=True).indices
    by_tensor = torch.sort(layout.owner[by_score], stable=True).indices
    return by_score[by_tensor][layout.take]


def block_positions(chosen: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """``[sum(keep) * block]`` int64: the entries of the ``chosen`` blocks in the call's row,
    block by block; the places past a shorter last block hold ``total`` (a padding slot).
    ``layout`` lies where ``chosen`` does (:meth:`BlockLayout.on`)."""
    offsets = torch.arange(layout.block, dtype=torch.int64, device=chosen.device)
    pos = layout.starts[chosen][:, None] + offsets[None, :]
    inside = pos < layout.ends[chosen][:, None]
    return torch.where(inside, pos, layout.total).reshape(-1)
