"""The collective protocol and exact byte accounting.

Tensors handed to a collective carry a leading *worker axis* of length ``local_workers``: the
workers this process holds (1 in a real process group, N in the simulator). Results that are
identical on every worker (a sum, a gathered set of messages) come back *without* that axis.

Accounting, per worker and per call, for a message of ``b`` bytes among ``W`` workers:

* ``payload``: the bytes of the message itself (values, indices, scales, sizes). For a padded
  all-gather it is the unpadded size the worker really had to say.
* ``wire``: what the ring algorithm makes this worker send.
  - ring all-reduce (reduce-scatter then all-gather): ``2 * (W - 1) * b / W`` (integer floor;
    the rounding of chunk sizes is ignored);
  - ring all-gather of ``b`` bytes per worker (padded size): ``(W - 1) * b``;
  - all-to-all of ``W`` parts of ``m`` bytes per worker: ``(W - 1) * m`` (a worker's own part
    stays with it), payload ``W * m``.
  With ``W == 1`` nothing is sent: wire bytes are zero, payload bytes still count the message.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from gradzip.ops.flat import cat_rows

__all__ = ["ByteMeter", "Collective", "allreduce_wire_bytes", "allgather_wire_bytes",
           "ordered_wire_bytes"]


def allreduce_wire_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one worker sends in a ring all-reduce of an ``nbytes`` buffer."""
    return 2 * (world_size - 1) * nbytes // world_size


def ordered_wire_bytes(entries: int, itemsize: int, world_size: int) -> int:
    """Bytes one worker sends in :meth:`Collective.all_reduce_ordered` of ``entries`` values of
    ``itemsize`` bytes: a ring all-reduce's, with the message cut into ``W`` whole parts."""
    if world_size == 1 or entries == 0:
        return 0
    return 2 * (world_size - 1) * itemsize * -(-entries // world_size)


def allgather_wire_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one worker sends in a ring all-gather of ``nbytes`` per worker."""
    return (world_size - 1) * nbytes


@dataclass
class ByteMeter:
    """Cumulative bytes per local worker; plain data, so it checkpoints as it is.

    Attributes:
        payload: message bytes per local worker.
        wire: bytes sent on the wire per local worker.
        calls: number of collective calls made.
    """

    workers: int
    payload: list[int] = field(default_factory=list)
    wire: list[int] = field(default_factory=list)
    calls: int = 0

    def __post_init__(self) -> None:
        if not self.payload:
            self.payload = [0] * self.workers
        if not self.wire:
            self.wire = [0] * self.workers

    def add(self, payload: Sequence[int], wire: Sequence[int]) -> None:
        for i in range(self.workers):
            self.payload[i] += int(payload[i])
            self.wire[i] += int(wire[i])
        self.calls += 1

    def snapshot(self) -> dict[str, object]:
        return {"payload": list(self.payload), "wire": list(self.wire), "calls": self.calls}

    def load(self, state: dict[str, object]) -> None:
        payload, wire = list(state["payload"]), list(state["wire"])  # type: ignore[call-overload]
        if len(payload) != self.workers or len(wire) != self.workers:
            raise ValueError(
                f"`meter` must hold {self.workers} workers, got {len(payload)} payload entries"
            )
        self.payload, self.wire, self.calls = payload, wire, int(state["calls"])  # type: ignore[arg-type]


class Collective(ABC):
    """Sum and gather across workers, with byte accounting.

    Subclasses implement ``_sum`` and ``_gather``; the public methods check shapes and count
    bytes so the accounting is the same for every implementation.

    Attributes:
        simulated: whether users hand gradients *with* the worker axis (a simulated group);
            a real process group takes each worker's plain gradient.
    """

    simulated: bool = False

    def __init__(self, world_size: int, local_workers: int, first_rank: int) -> None:
        self.world_size = world_size
        self.local_workers = local_workers
        self.first_rank = first_rank
        self.meter = ByteMeter(local_workers)

    @property
    def local_ranks(self) -> list[int]:
        """Global ranks of the workers held by this process."""
        return list(range(self.first_rank, self.first_rank + self.local_workers))

    # -- implementation hooks -------------------------------------------------------------
    @abstractmethod
    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        """``[L, ...] -> [...]``: the sum over every worker of the group."""

    @abstractmethod
    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[L, ...] -> [W, ...]``: every worker's tensor, in rank order."""

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        """``[L, W, ...] -> [L, W, ...]``: part ``j`` of every local worker goes to worker
        ``j``; row ``[l, i]`` of the result is what worker ``i`` sent local worker ``l``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement all_to_all")

    # -- public API -----------------------------------------------------------------------
    def _check(self, x: torch.Tensor) -> None:
        if x.dim() == 0 or x.shape[0] != self.local_workers:
            raise ValueError(
                f"`x` must have a leading worker axis of length {self.local_workers}, "
                f"got shape {tuple(x.shape)}"
            )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x[L, ...]`` over all workers; returns ``[...]``, identical everywhere."""
        self._check(x)
        nbytes = x[0].numel() * x.element_size()
        wire = allreduce_wire_bytes(nbytes, self.world_size)
        self.meter.add([nbytes] * self.local_workers, [wire] * self.local_workers)
        if self.world_size == 1:
            return x[0].clone()
        return self._sum(x)

    def all_reduce_cat(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """:meth:`all_reduce` of the concatenation of ``parts`` (each ``[L, ...]``, one dtype)
        along their flattened entries; returns ``[total]``. A subclass that appends its own
        elements to the message does it in the same copy (no second concatenation)."""
        flat = cat_rows(parts, self.local_workers)
        return self.all_reduce(flat)

    def all_reduce_(self, flat: torch.Tensor) -> None:
        """Sum this process's one worker's 1-D message ``flat`` over all workers, in place
        (metered as :meth:`all_reduce` of the same message). Only for ``local_workers == 1``.
        """
        if self.local_workers != 1 or flat.dim() != 1:
            raise ValueError(
                f"`flat` must be one worker's 1-D message (local_workers == 1), got shape "
                f"{tuple(flat.shape)} with {self.local_workers} local workers"
            )
        flat.copy_(self.all_reduce(flat[None]))

    def all_reduce_ordered(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x[L, m]`` over all workers, adding them in rank order on every backend.

        A reduce-scatter then an all-gather: one :meth:`all_to_all` of ``W`` parts of
        ``ceil(m / W)`` entries (part ``j`` to worker ``j``, which adds the parts it receives
        in rank order), then one :meth:`all_gather` of the owners' sums. The wire bytes are a
        ring all-reduce's (``2 (W-1) ceil(m / W)`` entries, counted by the two calls), and the
        bits are the same in a process group as in the simulator (a backend's all-reduce may
        add in another order: gloo's ring does from three workers on).

        Returns:
            ``[m]``, identical everywhere.
        """
        self._check(x)
        if x.dim() != 2:
            raise ValueError(f"`x` must be [local workers, m], got shape {tuple(x.shape)}")
        world, m = self.world_size, x.shape[1]
        if world == 1 or m == 0:
            return self.all_reduce(x)
        part = -(-m // world)
        parts = torch.nn.functional.pad(x, (0, part * world - m)).reshape(x.shape[0], world, part)
        received = self.all_to_all(parts)  # [L, W senders, part]
        total = received[:, 0].clone()
        for sender in range(1, world):  # rank order, on every worker and backend
            total += received[:, sender]
        return self.all_gather(total).reshape(-1)[:m]

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """Send part ``j`` of ``x[L, W, ...]`` to worker ``j`` (equal-size parts); returns
        ``[L, W, ...]``: for each local worker, the part every worker sent it, in rank order.
        """
        self._check(x)
        if x.dim() < 2 or x.shape[1] != self.world_size:
            raise ValueError(
                f"`x` must have one part per worker ({self.world_size}) on its second axis, "
                f"got shape {tuple(x.shape)}"
            )
        part = x[0, 0].numel() * x.element_size()
        self.meter.add([part * self.world_size] * self.local_workers,
                       [part * (self.world_size - 1)] * self.local_workers)
        if self.world_size == 1:
            return x.clone()
        return self._exchange(x)

    def all_gather(
        self, x: torch.Tensor, payload: Sequence[int] | None = None, *, metered: bool = True
    ) -> torch.Tensor:
        """Gather ``x[L, ...]`` from all workers; returns ``[W, ...]`` in rank order.

        Args:
            x: equal-size messages, padded by the caller where they vary.
            payload: unpadded message bytes per local worker (defaults to the padded size).
            metered: count the bytes in :attr:`meter` (off for one-off control messages that
                the caller accounts for separately).
        """
        self._check(x)
        nbytes = x[0].numel() * x.element_size()
        wire = allgather_wire_bytes(nbytes, self.world_size)
        if metered:
            self.meter.add(payload if payload is not None else [nbytes] * self.local_workers,
                           [wire] * self.local_workers)
        if self.world_size == 1:
            return x.clone()
        return self._gather(x)
