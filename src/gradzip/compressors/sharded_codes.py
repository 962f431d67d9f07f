"""The sharded quantised exchange: a reduce-scatter and an all-gather that both carry codes.

Any quantiser that encodes a row of values into a fixed-size message (a :class:`PartCodec`)
can average through it. Each tensor of ``n`` entries is cut into ``W`` contiguous parts of
``c = ceil(n / W)`` entries (part ``j`` is ``[j c, min(n, (j + 1) c))``, owned by worker
``j``; the last parts may be short or empty). Then:

1. every worker encodes each part of its (error-compensated) tensor on its own and sends part
   ``j`` to worker ``j`` (one all-to-all for every tensor of the call);
2. the owner decodes the ``W`` pieces it received, adds them in rank order, divides by ``W``,
   adds its *owner residual* (what its own re-encoding lost at earlier steps), encodes that
   part again with the same code and keeps the new loss as its owner residual;
3. every owner's encoded part is all-gathered and every worker decodes the whole average.

Per worker and per tensor that is ``2 (W - 1) B(c)`` wire bytes, ``B(m)`` being the codec's
message size for ``m`` entries: like a ring all-reduce, it does not grow with ``W`` (an
all-gather of whole messages costs ``(W - 1) B(n)``).

Why the arithmetic is independent of how tensors share a call: parts are cut per tensor, each
part is encoded with its own scales, and the owner adds the ``W`` pieces of one part in rank
order, so a tensor's bits depend on that tensor alone (DDP may bucket tensors differently
after a resume). Why every rank takes the same decisions: which form a tensor takes
(:func:`choose_exchange`) depends on its size, the world size and the configuration only.

Error feedback on both sides: a worker keeps ``tensor - decoded own message`` (the engine's
residual), the owner keeps ``average + old owner residual - decoded re-encoding`` (the state's
``owner`` entry, ``[local workers, c]`` per tensor), so what the re-encoding drops at one step
is sent at a later one (DoubleSqueeze, Tang et al., ICML 2019). That needs a code whose error
is smaller than what it encodes (sign, bin-mean); QSGD's unbiased rounding goes without an
owner residual (see :func:`sharded_reduce`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from gradzip.comm.base import Collective, allgather_wire_bytes, allreduce_wire_bytes
from gradzip.compressors.base import Job, StepContext
from gradzip.ops.flat import to_device

__all__ = [
    "EXCHANGES", "FORMS", "ExchangeStateCheck", "PartCodec", "check_exchange_state",
    "choose_exchange",
    "exchange_report", "init_exchange_state",
    "shard_size", "sharded_reduce", "sharded_wire_bytes", "split_by_form",
]

#: The values of a quantiser's ``exchange`` field.
EXCHANGES = ("auto", "allgather", "sharded")
#: The forms a tensor can take (:func:`choose_exchange`).
FORMS = ("allgather", "sharded", "dense")


class PartCodec(Protocol):
    """A quantiser's code for one part: ``m`` values to a message of :meth:`part_bytes` bytes."""

    def part_bytes(self, count: int) -> int:
        """Bytes of the message of ``count >= 1`` values (scales, codebook and codes)."""

    def encode_parts(self, x: torch.Tensor, draws: torch.Tensor | None) -> torch.Tensor:
        """``x[R, m]`` fp32 -> messages uint8 ``[R, part_bytes(m)]``, each row on its own;
        ``draws[R, m]`` are the row's random numbers (:meth:`part_draws`) or ``None``."""

    def decode_parts(self, messages: torch.Tensor, count: int) -> torch.Tensor:
        """Messages ``[R, part_bytes(count)]`` -> fp32 values ``[R, count]``."""

    def part_draws(self, key: tuple[Any, ...], count: int,
                   device: torch.device) -> torch.Tensor | None:
        """``count`` random draws keyed by ``key`` (in the form the codec's
        :meth:`encode_parts` reads them), or ``None`` for a deterministic code."""


def shard_size(numel: int, world_size: int) -> int:
    """Entries per part, ``ceil(numel / world_size)``."""
    return -(-numel // world_size)


def _length(numel: int, world_size: int, part: int) -> int:
    """Entries of part ``part`` of a tensor of ``numel`` entries."""
    c = shard_size(numel, world_size)
    return max(0, min(numel, (part + 1) * c) - part * c)


def sharded_wire_bytes(codec: PartCodec, numel: int, world_size: int) -> int:
    """Wire bytes one worker sends for one tensor through the sharded exchange."""
    return 2 * (world_size - 1) * codec.part_bytes(shard_size(numel, world_size))


def choose_exchange(codec: PartCodec, exchange: str, numel: int, world_size: int) -> str:
    """The form a tensor takes: ``"allgather"``, ``"sharded"`` or ``"dense"``.

    ``"auto"`` compares the wire bytes per worker of the three forms (an all-gather of the
    whole tensor's message, the sharded exchange, an fp32 ring all-reduce) and takes the
    sharded form only where it is strictly cheaper than the all-gather, the dense one only
    where it is strictly cheaper than both. With one worker nothing travels: the all-gather
    form (the quantiser's own). ``"allgather"`` and ``"sharded"`` force their form.

    Why it is safe in a real group: the answer depends on the size, the world size and the
    configuration only, identical on every rank, so every rank issues the same collectives.
    """
    if exchange == "allgather" or (exchange == "auto" and world_size == 1) or numel == 0:
        return "allgather"
    if exchange == "sharded":
        return "sharded"
    gather = allgather_wire_bytes(codec.part_bytes(numel), world_size)
    sharded = sharded_wire_bytes(codec, numel, world_size)
    dense = allreduce_wire_bytes(4 * numel, world_size)
    best = "sharded" if sharded < gather else "allgather"
    return "dense" if dense < min(gather, sharded) else best


def init_exchange_state(
    codec: PartCodec, exchange: str, shapes: Mapping[str, torch.Size], world_size: int,
    local_workers: int, *, owner_feedback: bool = True,
) -> dict[str, Any]:
    """The state the sharded exchange needs in a group: ``{"forms": name -> form, "owner":
    name -> zeros [local_workers, c]}`` (an owner residual for each tensor that takes the
    sharded form, with ``owner_feedback``). Plain data of the same structure on every
    worker."""
    forms, owner = {}, {}
    for name, shape in shapes.items():
        numel = torch.Size(shape).numel()
        forms[name] = choose_exchange(codec, exchange, numel, world_size)
        if forms[name] == "sharded" and owner_feedback:
            owner[name] = torch.zeros(local_workers, shard_size(numel, world_size))
    return {"forms": forms, "owner": owner}


def exchange_report(state: Mapping[str, Any]) -> dict[str, int]:
    """Tensors per form, from a state made by :func:`init_exchange_state` (empty without)."""
    forms = state.get("forms")
    if not isinstance(forms, Mapping):
        return {}
    return {form: sum(f == form for f in forms.values()) for form in FORMS}


def check_exchange_state(
    state: Mapping[str, Any], fresh: Mapping[str, Any] | None = None
) -> str | None:
    """The first value of a loaded exchange state that cannot be continued from: a form
    that is not one of :data:`FORMS` or differs from ``fresh``'s (forms follow from the
    shapes, the world size and the configuration), as ``Compressor.check_state`` reports."""
    forms = state.get("forms")
    if not isinstance(forms, Mapping):
        return None
    want = fresh.get("forms", {}) if fresh is not None else {}
    for name, form in forms.items():
        if form not in FORMS or (name in want and form != want[name]):
            expected = repr(want[name]) if name in want else "one of " + ", ".join(FORMS)
            return f"forms.{name}: must be {expected}, got {form!r}"
    return None


class ExchangeStateCheck:
    """``Compressor.check_state`` for a quantiser whose state is the sharded exchange's
    (:func:`init_exchange_state`): listed before ``Compressor`` among its bases."""

    def check_state(self, state: Mapping[str, Any], *, fresh: Mapping[str, Any],
                    **_: Any) -> str | None:
        """A form that differs from the one the shapes and world size give."""
        return check_exchange_state(state, fresh)


def split_by_form(
    jobs: Sequence[Job], codec: PartCodec, exchange: str, world_size: int
) -> dict[str, list[Job]]:
    """The jobs of each form (:func:`choose_exchange`), in their order."""
    out: dict[str, list[Job]] = {form: [] for form in FORMS}
    for job in jobs:
        out[choose_exchange(codec, exchange, job.numel, world_size)].append(job)
    return out


def _encode_by_length(codec: PartCodec, rows: torch.Tensor, lengths: Sequence[int],
                      draws: torch.Tensor | None, size: int) -> torch.Tensor:
    """Messages ``[R, size]`` of the rows of ``rows[R, c]``, row ``i`` holding ``lengths[i]``
    values (zero rows for empty parts, zero padding after shorter messages). Rows of one
    length are encoded together; each row is encoded on its own values only."""
    if all(m == rows.shape[1] for m in lengths):  # every part full: one batch, no copies
        return codec.encode_parts(rows, draws)
    out = torch.zeros(rows.shape[0], size, dtype=torch.uint8, device=rows.device)
    for length in sorted(set(lengths)):
        if length == 0:
            continue
        at = [i for i, m in enumerate(lengths) if m == length]
        index = to_device(torch.tensor(at), rows.device)  # queued: no host wait
        picked = rows.index_select(0, index)[:, :length]
        noise = None if draws is None else draws.index_select(0, index)[:, :length]
        message = codec.encode_parts(picked, noise)
        out.index_copy_(0, index, torch.nn.functional.pad(message, (0, size - message.shape[1])))
    return out


def _decode_by_length(codec: PartCodec, messages: torch.Tensor, lengths: Sequence[int],
                      width: int) -> torch.Tensor:
    """Values ``[R, width]`` of the messages ``[R, size]`` (row ``i`` holding ``lengths[i]``
    values, zeros after them)."""
    if all(m == width for m in lengths):
        return codec.decode_parts(messages, width)
    out = torch.zeros(messages.shape[0], width, dtype=torch.float32, device=messages.device)
    for length in sorted(set(lengths)):
        if length == 0:
            continue
        at = [i for i, m in enumerate(lengths) if m == length]
        index = to_device(torch.tensor(at), messages.device)
        picked = messages.index_select(0, index)[:, : codec.part_bytes(length)]
        values = codec.decode_parts(picked, length)
        out.index_copy_(0, index, torch.nn.functional.pad(values, (0, width - length)))
    return out


def _rank_order_sum(values: torch.Tensor) -> torch.Tensor:
    """``values[G, W, m]`` summed over the second axis, worker by worker in rank order: each
    entry sees the additions a process group's owner makes, whatever ``G``."""
    total = values[:, 0].clone()
    for w in range(1, values.shape[1]):
        total += values[:, w]
    return total


def sharded_reduce(
    jobs: Sequence[Job], state: dict[str, Any], comm: Collective, ctx: StepContext,
    codec: PartCodec, tag: str, *, owner_feedback: bool = True,
) -> None:
    """Average ``jobs`` through the sharded exchange; sets every job's ``averaged`` and
    ``decoded`` and, with ``owner_feedback``, replaces ``state["owner"]`` (creating entries
    it lacks, zeros).

    Owner feedback is for biased codes (sign, bin-mean), whose error is a fraction of what
    they encode, so error feedback keeps it bounded. An unbiased code whose variance may
    exceed the signal (QSGD with few levels over a large part) goes without: fed back, its
    errors would grow step after step; its fresh rounding at the owner keeps the average
    unbiased instead.

    Args:
        jobs: the tensors (any sizes); their messages travel in one all-to-all and one
            all-gather.
        state: the compressor's state (its ``"owner"`` entry is read and replaced).
        comm: the collective.
        ctx: the step (its number and the local ranks key the codec's random draws).
        codec: the quantiser's code.
        tag: what keys the draws of this compressor (its name and seed).

    Raises:
        ValueError: an owner residual of another shape than ``[local workers, c]``.
    """
    if not jobs:
        return
    world, workers = comm.world_size, comm.local_workers
    owners = dict(state.get("owner", {}))
    device = jobs[0].tensor.device
    sizes = [codec.part_bytes(shard_size(job.numel, world)) for job in jobs]
    outgoing = []
    for job, size in zip(jobs, sizes, strict=True):
        c = shard_size(job.numel, world)
        rows = torch.nn.functional.pad(job.tensor.reshape(workers, -1), (0, world * c - job.numel))
        rows = rows.reshape(workers * world, c)  # row l * W + j: worker l's part j
        lengths = [_length(job.numel, world, j) for j in range(world)] * workers
        draws = _draws(codec, (tag, ctx.step, job.name, "worker"), ctx.ranks, world * c, device)
        if draws is not None:
            draws = draws.reshape(workers * world, c)
        messages = _encode_by_length(codec, rows, lengths, draws, size)
        # What each worker's own message decodes to, from the very bytes the owners decode.
        decoded = _decode_by_length(codec, messages, lengths, c).reshape(workers, world * c)
        job.decoded = decoded[:, : job.numel].reshape(job.tensor.shape)
        outgoing.append(messages.reshape(workers, world, size))
    received = comm.all_to_all(torch.cat(outgoing, dim=2))  # [L, W senders, sum(sizes)]
    again, offset = [], 0
    for job, size in zip(jobs, sizes, strict=True):
        c = shard_size(job.numel, world)
        lengths = [_length(job.numel, world, rank) for rank in comm.local_ranks]
        pieces = received[:, :, offset : offset + size].reshape(workers * world, size)
        values = _decode_by_length(codec, pieces, [m for m in lengths for _ in range(world)], c)
        mean = _rank_order_sum(values.reshape(workers, world, c)).div_(world)
        target = mean
        if owner_feedback:
            old = owners.get(job.name)
            if old is None:
                old = torch.zeros(workers, c)
            if tuple(old.shape) != (workers, c):
                raise ValueError(
                    f"`state['owner'][{job.name!r}]` must have shape {(workers, c)}, got "
                    f"{tuple(old.shape)}"
                )
            target = mean + to_device(old, device)  # zero past each part's end, as padding
        draws = _draws(codec, (tag, ctx.step, job.name, "owner"), ctx.ranks, c, device)
        message = _encode_by_length(codec, target, lengths, draws, size)
        if owner_feedback:
            owners[job.name] = target - _decode_by_length(codec, message, lengths, c)
        again.append(message)
        offset += size
    gathered = comm.all_gather(torch.cat(again, dim=1))  # [W, sum(sizes)]
    offset = 0
    for job, size in zip(jobs, sizes, strict=True):
        c = shard_size(job.numel, world)
        lengths = [_length(job.numel, world, j) for j in range(world)]
        parts = _decode_by_length(codec, gathered[:, offset : offset + size], lengths, c)
        job.averaged = parts.reshape(-1)[: job.numel].reshape(job.shape)
        offset += size
    if owner_feedback:
        state["owner"] = owners


def _draws(codec: PartCodec, key: tuple[Any, ...], ranks: Sequence[int], count: int,
           device: torch.device) -> torch.Tensor | None:
    """``[L, count]``: each local rank's draws (``None`` for a deterministic codec). Keyed by
    the rank, never by the process: a simulator and a process group draw the same numbers."""
    rows = [codec.part_draws((*key, rank), count, device) for rank in ranks]
    if any(r is None for r in rows):
        return None
    return torch.stack(rows)  # type: ignore[arg-type]
