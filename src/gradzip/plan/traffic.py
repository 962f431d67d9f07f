"""What one exchange sends, measured by running the real compressor in the simulator.

The cost model does not carry byte formulas of its own: it runs the compressor once through an
:class:`~gradzip.Engine` over a :class:`~gradzip.SimulatedGroup` on seeded random tensors of
the model's shapes and records every collective call (its kind and message size). The wire
bytes then follow from the same formulas the byte meter uses (:mod:`gradzip.comm.base`), so
the plan cannot drift from the code.

Two ways keep the simulation small:

* a parameter *count* is laid out as identical ``BLOCK x BLOCK`` matrices plus a remainder;
  the exchange is simulated with one and with two blocks and every call's size extrapolated
  linearly to the real number of blocks (exact where a compressor's message grows by the same
  amount per identical tensor, which :mod:`tests.test_plan` checks against full simulations);
* a shape list whose ``workers x entries`` exceeds ``limit`` is simulated with fewer workers
  and the wire bytes computed for the real ``W`` from the recorded message sizes
  (:attr:`Traffic.exact` is then ``False``: a compressor whose message size depends on ``W``,
  such as ``scatterq``'s per-worker chunks, is approximated).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from gradzip.comm.base import allgather_wire_bytes, allreduce_wire_bytes
from gradzip.comm.simulated import SimulatedGroup
from gradzip.engine import Engine

__all__ = ["BLOCK", "Call", "Traffic", "count_layout", "measure_traffic"]

#: The side of the square matrices a parameter count is laid out in.
BLOCK = 512

#: ``workers x entries`` above which a shape list is simulated with fewer workers.
DEFAULT_LIMIT = 1 << 24

#: Ring hops (latency terms) of one call of each kind among ``W`` workers.
_HOPS = {"all_reduce": lambda w: 2 * (w - 1), "all_gather": lambda w: w - 1,
         "all_to_all": lambda w: w - 1}


@dataclass(frozen=True)
class Call:
    """One collective call of an exchange.

    Attributes:
        kind: ``"all_reduce"``, ``"all_gather"`` or ``"all_to_all"``.
        nbytes: the message per worker (an all-gather's padded size; an all-to-all's whole
            send buffer, all ``W`` parts).
        payload: the unpadded message bytes per worker (the largest over workers).
    """

    kind: str
    nbytes: int
    payload: int

    def wire(self, workers: int) -> int:
        """Bytes one worker sends for this call among ``workers`` (comm/base.py's rules)."""
        if self.kind == "all_reduce":
            return allreduce_wire_bytes(self.nbytes, workers)
        if self.kind == "all_gather":
            return allgather_wire_bytes(self.nbytes, workers)
        return (workers - 1) * (self.nbytes // workers)

    def hops(self, workers: int) -> int:
        """Latency terms of this call in a ring of ``workers``."""
        return _HOPS[self.kind](workers)


@dataclass(frozen=True)
class Traffic:
    """The collective calls of one exchange (one optimizer step, or one outer sync).

    Attributes:
        workers: the ``W`` the wire bytes are for.
        calls: every call, in order.
        exact: whether the calls were simulated at ``W`` itself (see the module docstring).
    """

    workers: int
    calls: tuple[Call, ...]
    exact: bool = True

    @property
    def wire_bytes(self) -> int:
        """Bytes one worker sends per exchange."""
        return sum(c.wire(self.workers) for c in self.calls)

    @property
    def payload_bytes(self) -> int:
        """Message bytes one worker says per exchange."""
        return sum(c.payload for c in self.calls)

    @property
    def hops(self) -> int:
        """Latency terms per exchange, summed over its calls."""
        return sum(c.hops(self.workers) for c in self.calls)


class _Recorder(SimulatedGroup):
    """A simulated group that also lists each metered call (kind and sizes)."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self.calls: list[Call] = []

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        out = super().all_reduce(x)
        nbytes = x[0].numel() * x.element_size()
        self.calls.append(Call("all_reduce", nbytes, nbytes))
        return out

    def all_gather(self, x: torch.Tensor, payload: Sequence[int] | None = None, *,
                   metered: bool = True) -> torch.Tensor:
        out = super().all_gather(x, payload, metered=metered)
        if metered:  # the byte meter's rule: unmetered control messages are not counted
            nbytes = x[0].numel() * x.element_size()
            said = max(payload) if payload is not None else nbytes
            self.calls.append(Call("all_gather", nbytes, int(said)))
        return out

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        out = super().all_to_all(x)
        nbytes = x[0].numel() * x.element_size()
        self.calls.append(Call("all_to_all", nbytes, nbytes))
        return out


def count_layout(params: int, blocks: int | None = None) -> dict[str, tuple[int, ...]]:
    """How a bare parameter count is laid out: ``BLOCK x BLOCK`` matrices, one matrix of the
    remaining whole rows, and a vector of the rest.

    Args:
        params: the number of parameters (>= 1).
        blocks: how many full blocks to keep (default: all); the remainder stays.

    Returns:
        ``name -> shape``.
    """
    full, rest = divmod(params, BLOCK * BLOCK)
    rows, tail = divmod(rest, BLOCK)
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(full if blocks is None else min(blocks, full)):
        shapes[f"block{i}"] = (BLOCK, BLOCK)
    if rows:
        shapes["rows"] = (rows, BLOCK)
    if tail:
        shapes["tail"] = (tail,)
    return shapes


def _simulate(spec: str, shapes: Mapping[str, tuple[int, ...]], workers: int,
              seed: int) -> list[Call]:
    """The calls of one engine step of ``spec`` over ``workers`` simulated workers."""
    params = {name: torch.zeros(shape) for name, shape in shapes.items()}
    group = _Recorder(workers)
    engine = Engine(params, spec, collective=group)
    gen = torch.Generator().manual_seed(seed)
    grads = {name: torch.randn((workers, *shape), generator=gen) for name, shape in shapes.items()}
    # same_layout=True: the per-call header rides in the first message, as in the DDP hook.
    engine.reduce(grads, same_layout=True)
    # Every metered byte must be in a recorded call, or the plan would miss traffic.
    recorded = sum(c.wire(workers) for c in group.calls)
    assert recorded == engine.stats["wire_bytes"][0], (spec, recorded, engine.stats)
    return group.calls


def measure_traffic(spec: str, workers: int, *, shapes: Mapping[str, tuple[int, ...]] | None = None,
                    params: int | None = None, limit: int = DEFAULT_LIMIT,
                    seed: int = 0) -> Traffic:
    """The collective calls of one exchange of ``spec`` among ``workers``.

    Args:
        spec: a compressor spec (``"powersgd:rank=4"``).
        workers: ``W`` (>= 1).
        shapes: ``name -> shape`` of the model's parameters; or
        params: a parameter count (laid out by :func:`count_layout`).
        limit: ``workers x entries`` above which fewer workers are simulated.
        seed: seed of the random gradients.

    Returns:
        A :class:`Traffic`.
    """
    if (shapes is None) == (params is None):
        raise ValueError("exactly one of `shapes` and `params` must be given, got "
                         f"{'both' if shapes is not None else 'neither'}")
    if params is not None:
        full = params // (BLOCK * BLOCK)
        if full <= 2:
            return measure_traffic(spec, workers, shapes=count_layout(params), limit=limit,
                                   seed=seed)
        one = measure_traffic(spec, workers, shapes=count_layout(params, 1), limit=limit, seed=seed)
        two = measure_traffic(spec, workers, shapes=count_layout(params, 2), limit=limit, seed=seed)
        same = len(one.calls) == len(two.calls) and all(
            a.kind == b.kind for a, b in zip(one.calls, two.calls, strict=True))
        if not same:  # the call structure changed with the size: simulate it all
            return measure_traffic(spec, workers, shapes=count_layout(params), limit=limit,
                                   seed=seed)
        calls = tuple(
            Call(a.kind, a.nbytes + (full - 1) * (b.nbytes - a.nbytes),
                 a.payload + (full - 1) * (b.payload - a.payload))
            for a, b in zip(one.calls, two.calls, strict=True))
        return Traffic(workers, calls, one.exact and two.exact)
    assert shapes is not None
    entries = sum(max(1, _numel(s)) for s in shapes.values())
    sim_workers = workers if workers * entries <= limit else max(2, min(workers, limit // entries))
    calls = _simulate(spec, shapes, sim_workers, seed)
    if sim_workers != workers:
        # An all-to-all's send buffer holds one part per worker: rescale it to W parts.
        calls = [Call(c.kind, c.nbytes // sim_workers * workers, c.payload // sim_workers * workers)
                 if c.kind == "all_to_all" else c for c in calls]
    return Traffic(workers, tuple(calls), sim_workers == workers)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
