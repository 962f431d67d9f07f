"""The cost model: per-step bytes, calls, link time and step time of each candidate.

A step of a per-step candidate costs, per worker::

    step = compute + compress + max(0, comm - overlap_window)
    comm = buckets * hops * rtt + wire_bytes * 8 / bandwidth              (alpha-beta)
    overlap_window = backward_fraction * compute * (buckets - 1) / buckets  (overlap on)

``wire_bytes`` and ``hops`` come from simulating the compressor (:mod:`.traffic`): a ring
all-reduce among ``W`` workers pays ``2 (W - 1)`` latency terms of one round trip each and sends
``2 (W - 1) / W`` of its message, an all-gather ``W - 1`` terms and ``(W - 1)`` messages. The
overlap assumption is the DDP hook's: a bucket's exchange starts when its gradients are ready,
so every bucket but the last can hide behind the rest of the backward pass (taken as
``backward_fraction`` of the compute time, 2/3 by default: backward costs about twice the
forward); with one bucket, or the synchronous hook, nothing overlaps. Each bucket is its own
exchange, so latency terms are paid once per bucket (bytes are not).

An outer-step candidate (``H`` local steps between exchanges) pays one exchange of the
pseudo-gradient every ``H`` steps, synchronously::

    step = compute + (compress + comm) / H
"""

from __future__ import annotations

from dataclasses import dataclass

from gradzip._validate import check_bool, check_int, check_real
from gradzip.plan.candidates import Candidate
from gradzip.plan.traffic import Traffic

__all__ = ["Prediction", "Setting", "comm_seconds", "predict_candidate"]


@dataclass(frozen=True)
class Setting:
    """Where a model trains: workers, link and compute.

    Attributes:
        workers: ``W``, data-parallel workers (>= 2).
        bandwidth_mbit: each worker's link, Mbit/s each way (> 0).
        rtt_ms: round-trip time between neighbours in ms (>= 0).
        step_ms: compute time of one step (forward, backward, optimizer) without any
            communication, ms (> 0).
        buckets: DDP buckets per step (>= 1).
        overlap: whether the hook overlaps buckets' exchanges with the backward pass.
        backward_fraction: the share of ``step_ms`` that is the backward pass, in [0, 1].

    Raises:
        TypeError, ValueError: an invalid field, naming it.
    """

    workers: int
    bandwidth_mbit: float
    rtt_ms: float
    step_ms: float
    buckets: int = 1
    overlap: bool = True
    backward_fraction: float = 2 / 3

    def __post_init__(self) -> None:
        check_int("workers", self.workers, minimum=2)
        check_real("bandwidth_mbit", self.bandwidth_mbit, low=0, low_open=True)
        check_real("rtt_ms", self.rtt_ms, low=0)
        check_real("step_ms", self.step_ms, low=0, low_open=True)
        check_int("buckets", self.buckets, minimum=1)
        check_bool("overlap", self.overlap)
        check_real("backward_fraction", self.backward_fraction, low=0, high=1)

    @property
    def overlap_window_ms(self) -> float:
        """Communication time a per-step exchange can hide behind the backward pass."""
        if not self.overlap:
            return 0.0
        return self.backward_fraction * self.step_ms * (self.buckets - 1) / self.buckets


def comm_seconds(wire_bytes: float, hops: float, bandwidth_mbit: float, rtt_ms: float) -> float:
    """Alpha-beta link time: ``hops`` latency terms of one round trip each, plus the bytes at
    line rate.

    A hop costs a whole round trip, not the half a packet's one-way trip would suggest: gloo's
    TCP transport sends a message only after the receiver has said it is ready for it, so every
    sequential transfer waits one round trip before its bytes move. Measured through a 100 ms
    delay line (two workers, ``benchmarks/netem_rtt_probe.py``): PowerSGD's two all-reduces
    added 4.0-4.1 round trips per step, which half a round trip per hop put at 2.

    Args:
        wire_bytes: bytes one worker sends.
        hops: latency terms (a ring all-reduce among ``W``: ``2 (W - 1)``).
        bandwidth_mbit: the link, Mbit/s (> 0).
        rtt_ms: round-trip time, ms (>= 0).

    Returns:
        Seconds.
    """
    check_real("wire_bytes", wire_bytes, low=0)
    check_real("hops", hops, low=0)
    check_real("bandwidth_mbit", bandwidth_mbit, low=0, low_open=True)
    check_real("rtt_ms", rtt_ms, low=0)
    return hops * rtt_ms / 1e3 + wire_bytes * 8 / (bandwidth_mbit * 1e6)


@dataclass(frozen=True)
class Prediction:
    """What one candidate costs in one setting.

    Attributes:
        candidate: the candidate.
        wire_bytes: bytes one worker sends per exchange.
        payload_bytes: message bytes per worker per exchange.
        calls: collective calls per exchange (times the buckets for a per-step candidate).
        comm_ms: link time of one exchange (alpha-beta).
        exposed_comm_ms: link time per step not hidden behind the backward pass.
        compress_ms: compression time per exchange (``None``: not measured, counted as 0).
        step_ms: predicted time per step.
        exact_bytes: whether the bytes were simulated at this ``W`` exactly.
    """

    candidate: Candidate
    wire_bytes: int
    payload_bytes: int
    calls: int
    comm_ms: float
    exposed_comm_ms: float
    compress_ms: float | None
    step_ms: float
    exact_bytes: bool

    @property
    def exchanges_per_step(self) -> float:
        """1 for a per-step candidate, ``1 / H`` for an outer-step one."""
        h = self.candidate.outer_steps
        return 1.0 / h if h else 1.0

    @property
    def wire_bytes_per_step(self) -> float:
        """Bytes one worker sends per step (averaged over ``H`` for an outer candidate)."""
        return self.wire_bytes * self.exchanges_per_step

    @property
    def calls_per_step(self) -> float:
        """Collective calls per step (averaged over ``H`` for an outer candidate)."""
        return self.calls * self.exchanges_per_step

    def as_dict(self) -> dict[str, object]:
        """Plain data for JSON."""
        c = self.candidate
        return {"name": c.name, "spec": c.spec, "quality": c.quality,
                "outer_steps": c.outer_steps, "outer_lr": c.outer_lr,
                "outer_momentum": c.outer_momentum, "wire_bytes_per_exchange": self.wire_bytes,
                "payload_bytes_per_exchange": self.payload_bytes,
                "wire_bytes_per_step": self.wire_bytes_per_step,
                "calls_per_exchange": self.calls, "calls_per_step": self.calls_per_step,
                "comm_ms_per_exchange": self.comm_ms, "exposed_comm_ms": self.exposed_comm_ms,
                "compress_ms_per_exchange": self.compress_ms, "step_ms": self.step_ms,
                "exact_bytes": self.exact_bytes}


def predict_candidate(candidate: Candidate, traffic: Traffic, setting: Setting,
                      compress_seconds: float | None) -> Prediction:
    """The prediction of one candidate from its simulated traffic (a pure function).

    Args:
        candidate: the candidate.
        traffic: one exchange of its spec among ``setting.workers`` (:func:`measure_traffic`).
        setting: workers, link, compute.
        compress_seconds: one worker's compression time per exchange, or ``None``.

    Returns:
        A :class:`Prediction`.

    Raises:
        ValueError: ``traffic`` is for another number of workers.
    """
    if traffic.workers != setting.workers:
        raise ValueError(f"`traffic` must be for {setting.workers} workers, got "
                         f"{traffic.workers}")
    if compress_seconds is not None:
        check_real("compress_seconds", compress_seconds, low=0)
    compress_ms = None if compress_seconds is None else compress_seconds * 1e3
    spent = compress_ms or 0.0
    if candidate.outer_steps:
        calls, hops = len(traffic.calls), traffic.hops
    else:  # one exchange per DDP bucket: latency per bucket, bytes split among them
        calls, hops = len(traffic.calls) * setting.buckets, traffic.hops * setting.buckets
    comm_ms = 1e3 * comm_seconds(traffic.wire_bytes, hops, setting.bandwidth_mbit,
                                 setting.rtt_ms)
    if candidate.outer_steps:
        exposed = comm_ms / candidate.outer_steps
        step = setting.step_ms + exposed + spent / candidate.outer_steps
    else:
        exposed = max(0.0, comm_ms - setting.overlap_window_ms)
        step = setting.step_ms + spent + exposed
    return Prediction(candidate, traffic.wire_bytes, traffic.payload_bytes, calls, comm_ms,
                      exposed, compress_ms, step, traffic.exact)

