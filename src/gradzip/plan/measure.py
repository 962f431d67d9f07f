"""What :class:`~gradzip.plan.auto.Auto` measures and how it turns that into a decision.

Pure functions over plain numbers (and one collective each for the link probe and the
aggregation), kept apart from the controller's step logic:

* :func:`fit_link`: bandwidth and latency from timed messages of different sizes;
* :func:`fit_probe`: :func:`fit_link` over the calls :func:`probe_link` made;
* :func:`probe_link`: time those all-reduces on the group, the large one grown until its
  size costs measurable time;
* :func:`max_over_ranks`: the element-wise maximum of a few floats over every rank;
* :func:`pick`: the fastest predicted level, with hysteresis and the quality guard.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence

import torch

from gradzip.comm.base import Collective, allreduce_wire_bytes

__all__ = ["fit_link", "fit_probe", "max_over_ranks", "median", "pick", "probe_link"]

#: Bandwidth used when the probe sees no cost of size (one worker, or noise): effectively
#: free bytes, so only latency and compute count.
UNBOUNDED_MBIT = 1e9

#: The time the last growth of the probe message must cost (at least) to stop growing it.
PROBE_RESOLVED_S = 5e-3


def median(values: Sequence[float]) -> float:
    """The median of ``values`` (0.0 when empty)."""
    return float(statistics.median(values)) if values else 0.0


def fit_link(small: tuple[int, float], large: tuple[int, float], hops: int, *,
             start: tuple[int, float] | None = None) -> tuple[float, float]:
    """The alpha-beta link (as :func:`~gradzip.plan.model.comm_seconds` reads it) from
    all-reduces of different sizes.

    ``seconds = hops x rtt + wire x 8 / bandwidth``: the bandwidth is the slope between two
    sizes, the smallest call gives what is left for latency. The slope is taken between
    ``start`` and ``large`` where a mid-sized ``start`` is given, else between ``small`` and
    ``large``: a cost every message beyond some size pays once (a token bucket's burst sent
    at line rate, a transport's start) then cancels out of the slope.

    Args:
        small: ``(wire bytes, seconds)`` of the small all-reduce.
        large: ``(wire bytes, seconds)`` of the large one.
        hops: latency terms of one all-reduce (``2 (W - 1)``).
        start: ``(wire bytes, seconds)`` of a call larger than ``small`` and smaller than
            ``large``, or ``None``.

    Returns:
        ``(bandwidth_mbit, rtt_ms)``: bandwidth :data:`UNBOUNDED_MBIT` where the sizes cost
        no measurable time difference; rtt 0 where the bytes explain all of the small call.

    Raises:
        ValueError: the sizes are not increasing, or a negative or non-finite time.
    """
    (w_s, t_s), (w_l, t_l) = small, large
    low = small if start is None else start
    if hops > 0 and not w_s <= low[0] < w_l:
        raise ValueError(f"`large` must send more bytes than `small` (and `start`, between "
                         f"them), got {w_s}, {None if start is None else low[0]}, {w_l}")
    for name, t in (("small", t_s), ("large", t_l), ("start", low[1])):
        if not math.isfinite(t) or t < 0:
            raise ValueError(f"`{name}` seconds must be finite and >= 0, got {t!r}")
    if hops == 0:  # one worker: nothing crosses a link
        return UNBOUNDED_MBIT, 0.0
    per_byte = (t_l - low[1]) / (w_l - low[0])
    bandwidth = UNBOUNDED_MBIT if per_byte <= 8 / (UNBOUNDED_MBIT * 1e6) else 8 / (per_byte * 1e6)
    latency = max(0.0, t_s - w_s * max(per_byte, 0.0)) / hops
    return bandwidth, 1e3 * latency


def fit_probe(calls: Sequence[tuple[int, float]], hops: int) -> tuple[float, float]:
    """:func:`fit_link` over the calls :func:`probe_link` made (``(wire bytes, seconds)``,
    the one-float call first; their times as one rank saw them, or the maxima over the
    ranks): the bandwidth from the slope between the two largest messages, the latency from
    the one-float call."""
    return fit_link(calls[0], calls[-1], hops, start=calls[-2] if len(calls) > 2 else None)


def probe_link(comm: Collective, probe_bytes: int, clock: Callable[[], float],
               device: torch.device, limit_bytes: int = 0, *,
               lined_up: bool = False) -> list[tuple[int, float]]:
    """Time an all-reduce of one float, then all-reduces of ``probe_bytes`` and larger, after
    an untimed one.

    The untimed first call lines the ranks up: a rank that arrives early waits inside it,
    not inside the timed ones (the waiting would read as latency). Any collective does that,
    so a caller whose last collective returned just before this call (no work of its own in
    between) passes ``lined_up`` and the untimed call is left out: on a long link every call
    costs at least the link's latency on each of its hops (a one-float all-reduce of two
    workers took 101 ms over a 100 ms round trip).

    A message of ``probe_bytes`` (64 KiB by default) can cost no more than the small one on a
    fast link: it hides under the fixed costs of a call, or inside a token bucket's burst
    sent at line rate, and the bandwidth read from it is noise (this read 1,600 Mbit/s to
    "unbounded" on a 1000 Mbit/s emulated link). So the message grows 4x at a time, up to
    ``limit_bytes`` (the tensors' dense size: no exchange sends more), until the last growth
    cost at least :data:`PROBE_RESOLVED_S` or a quarter of the small call's time, whichever
    is more. Whether to grow is decided from the maxima of the times over the ranks (one
    small all-reduce per growth), so every rank sends the same sequence of calls. Where it
    grew, the second-largest message, the slope's lower end, is sent once more and the
    faster of its two calls kept: a pause inside it would read the link as faster.

    Args:
        comm: the group.
        probe_bytes: the first large message's size.
        clock: seconds as a float.
        device: where the messages live.
        limit_bytes: the largest message (``probe_bytes`` where smaller).
        lined_up: the ranks were just lined up by the caller's own collective (the same on
            every rank).

    Returns:
        ``[(wire, seconds), ...]`` of the small call and of each large size, in order, as
        this rank's clock saw them (the second-largest's the faster of its two calls); the
        wire bytes as the collective meters them.

    Raises:
        TypeError: ``lined_up`` is not a bool.
    """
    if not isinstance(lined_up, bool):
        raise TypeError(f"`lined_up` must be a bool, got {type(lined_up).__name__}")
    workers = comm.local_workers

    def timed(numel: int) -> tuple[int, float]:
        x = torch.zeros(workers, numel, dtype=torch.float32, device=device)
        start = clock()
        comm.all_reduce(x)
        return allreduce_wire_bytes(numel * 4, comm.world_size), clock() - start

    if not lined_up:
        timed(1)
    calls = [timed(1)]
    numel = max(2, probe_bytes // 4)
    cap = max(numel, limit_bytes // 4)
    calls.append(timed(numel))
    before = numel
    while numel < cap:
        if len(calls) > 2:
            t_small, t_before, t_last = max_over_ranks(
                comm, [calls[0][1], calls[-2][1], calls[-1][1]], device)
            if t_last - t_before >= max(PROBE_RESOLVED_S, t_small / 4):
                break
        before, numel = numel, min(cap, 4 * numel)
        calls.append(timed(numel))
    if len(calls) > 2:
        # The slope's lower end is timed again and the faster call kept. A pause inside it
        # (the other worker's process scheduled first on a busy machine) shrinks the slope
        # and reads the link as faster than it is: one such call read a 150 Mbit/s link as
        # 233, and in a race probes read it as 264-284, which kept per-step communication
        # where outer steps won. The message is at most a quarter of the largest, so the
        # repeat costs at most a quarter of the growth's time; a pause inside the largest
        # reads the link slower instead.
        calls[-2] = min(calls[-2], timed(before), key=lambda c: c[1])
    return calls


def max_over_ranks(comm: Collective, values: Sequence[float], device: torch.device) -> list[float]:
    """The element-wise maximum of ``values`` over every rank, with one all-reduce.

    Each rank writes its values in its own row of a ``[world_size, k]`` float64 tensor of
    zeros; the sum therefore holds every rank's row, identical on every rank, and each takes
    the same maximum. The tensor is ``world_size x k x 8`` bytes, metered like any call.

    Args:
        comm: the group.
        values: this process's values (every local worker of a simulated group shares them:
            they share the clock).
        device: where the tensor lives.

    Returns:
        The maxima, ``len(values)`` floats.
    """
    rows = torch.zeros(comm.local_workers, comm.world_size, len(values), dtype=torch.float64,
                       device=device)
    mine = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    for i, rank in enumerate(comm.local_ranks):
        rows[i, rank] = mine
    return comm.all_reduce(rows).amax(dim=0).tolist()


def pick(predicted: Mapping[str, float], allowed: Sequence[str], current: str,
         margin: float) -> str:
    """The level to run next.

    The fastest allowed level (the first in ``allowed``'s order on a tie); the current level
    is kept unless that one is predicted at least ``margin`` faster, or the current level is
    no longer allowed.

    Args:
        predicted: ``level -> predicted seconds (or ms) per step``.
        allowed: the levels the quality guard allows, in the controller's order.
        current: the level running now.
        margin: the fraction a switch must gain, in [0, 1).

    Returns:
        A level of ``allowed``.
    """
    best = min(allowed, key=lambda lv: predicted[lv])
    if current in allowed and predicted[best] >= (1 - margin) * predicted[current]:
        return current
    return best
