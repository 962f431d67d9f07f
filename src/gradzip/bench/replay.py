"""Replaying a group from one process: what the other workers sent is recorded once, then
one worker's ``reduce`` runs alone against those recorded messages.

The kernel benchmark (:mod:`gradzip.bench.micro`) times this one worker: it does the work of a
member of a ``W``-worker group (its own selection, packing, error-feedback message, and the
sum or stack of all ``W`` messages), minus the transport, in one worker's memory.
"""

from __future__ import annotations

import copy
import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradzip.comm.base import Collective
from gradzip.compressors.base import Compressor, Job, StepContext

__all__ = ["RecordedGroup", "record_messages"]


class RecordedGroup(Collective):
    """Worker ``rank`` of a group of ``world`` whose other workers' messages were recorded.

    An all-reduce adds the ``world`` messages in rank order in this process (as
    :class:`~gradzip.SimulatedGroup` does), an all-gather stacks them, an all-to-all takes
    this worker's part of each. Messages this worker
    sends are kept in :attr:`sent`, entry times of each call in :attr:`entries`. Where no
    recorded message of the right shape exists (an earlier recording pass), this worker's own
    message stands in and :attr:`consistent` turns false.

    Args:
        world: the group size.
        rank: the worker this process plays.
        others: ``others[w][call]``, what worker ``w`` sent to each collective call (as
            :func:`record_messages` returns it); ``None`` before anything was recorded.
    """

    def __init__(self, world: int, rank: int, others: Sequence[Sequence[torch.Tensor]] | None
                 ) -> None:
        super().__init__(world_size=world, local_workers=1, first_rank=rank)
        self.others = others
        self.sent: list[torch.Tensor] = []
        self.entries: list[float] = []
        self.consistent = True

    def _rows(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.entries.append(time.perf_counter())
        call = len(self.sent)
        self.sent.append(x)
        rows = []
        for w in range(self.world_size):
            theirs = None
            if w != self.first_rank and self.others is not None and call < len(self.others[w]):
                theirs = self.others[w][call]
            if w == self.first_rank:
                theirs = x
            elif theirs is None or theirs.shape != x.shape or theirs.dtype != x.dtype:
                self.consistent = False
                theirs = x
            rows.append(theirs[0])
        return rows

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        rows = self._rows(x)
        total = rows[0].clone()
        for row in rows[1:]:
            total += row
        return total

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._rows(x))

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        # Worker w's message to this worker is part `rank` of what it handed the all-to-all.
        rank = self.first_rank
        return torch.stack([row[rank] for row in self._rows(x)])[None]


def _fingerprint(messages: Sequence[torch.Tensor]) -> list[tuple[Any, ...]]:
    out = []
    for m in messages:
        raw = m.detach().contiguous().view(torch.uint8).reshape(-1).numpy()
        out.append((tuple(m.shape), m.dtype, hashlib.blake2b(memoryview(raw)).hexdigest()))
    return out


def record_messages(
    compressor: Compressor, state: dict[str, Any], jobs_of: Callable[[int], list[Job]],
    world: int, max_passes: int = 8,
) -> list[list[torch.Tensor]]:
    """Every worker's messages, per collective call, in one step of a group of ``world``.

    Each worker runs alone (one worker's memory at a time, not ``world``'s), seeing the
    others' messages of the previous pass; a message that depends on an earlier exchange
    (PowerSGD's ``Q``, the threshold's padded values) is right once that exchange was, so the
    passes reach a fixed point after as many passes as there are calls, plus one to confirm.

    Args:
        compressor: the compressor.
        state: its initial state (copied for every run).
        jobs_of: fresh jobs holding worker ``w``'s gradients (``[1, *shape]``).
        world: the group size.
        max_passes: give up after this many passes.

    Returns:
        ``messages[w][call]``: what worker ``w`` handed to each collective call.

    Raises:
        RuntimeError: no fixed point was reached.
    """
    previous: list[list[tuple[Any, ...]]] | None = None
    recorded: list[list[torch.Tensor]] | None = None
    for _ in range(max_passes):
        sent, consistent = [], True
        for w in range(world):
            exchange = RecordedGroup(world, w, recorded)
            compressor.reduce(jobs_of(w), copy.deepcopy(state), exchange,
                              StepContext(step=0, ranks=(w,), world_size=world))
            sent.append(exchange.sent)
            consistent = consistent and exchange.consistent
        prints = [_fingerprint(m) for m in sent]
        if consistent and prints == previous:
            return sent
        previous, recorded = prints, sent
    raise RuntimeError(f"the messages of {compressor.spec()} did not settle in {max_passes} passes")
