"""A sparse exchange whose bytes per worker do not grow with the number of workers.

The all-gather of sparse messages makes every worker receive ``W - 1`` messages of ``k``
entries. This exchange instead cuts each tensor of ``n`` entries into ``W`` contiguous parts
of ``c = ceil(n / W)`` entries (part ``j`` is ``[j c, min(n, (j + 1) c))``, owned by worker
``j``), per tensor, so that a tensor's arithmetic never depends on which tensors share a call:

1. *Sparse reduce-scatter.* Each worker selects as its compressor does (its top-k, its entries
   above lambda, its chunks' top-k) from its compensated tensor outside its own part, splits the selection by part and sends each owner a part
   of fixed capacity ``capacity = min(c, ceil(SLACK * kept / W))`` entries (all-to-all): the
   largest selected entries of the part, padded with (index ``c``, value 0). Sizes depend on
   shapes and configuration only, so no worker reads a count on the host. Selected entries
   over capacity are not sent and stay in the worker's residual.
2. *Owner step.* Owner ``j`` sums, in rank order, the pieces of part ``j`` it received, with
   its own compensated part added whole at its own rank's turn (its part never travels, so
   it costs nothing to take all of it). It keeps the ``keep = min(c, ceil(owner_keep * kept /
   W))`` largest entries of that sum and leaves the rest in its own residual, at its own part's
   positions: the owner's residual is the owner worker's error-feedback residual there.
3. *All-gather.* Each owner all-gathers its ``keep`` entries, or its whole part as fp32 where
   that is fewer bytes (``4 c <= keep * entry``: the switch to dense of SparCML).

Entries travel as an fp32 value and an index within the part (int16 where the part has fewer
than 32,767 entries, else int32). Wire bytes per worker and tensor:
``(W - 1) * (capacity * entry + min(keep * entry, 4 c))``, about
``(SLACK + owner_keep) * kept * entry`` whatever ``W``; the all-gather's are ``(W - 1) * kept * entry``.

Every worker's residual stays exactly what its compensated gradient holds minus what it
contributed: outside its part, the entries it did not send; in its part, the sum it did not
pass on. Summed over workers, residuals plus ``W`` times the average are the compensated
gradients' sum: nothing is lost, only delayed (error feedback on both sides, as in
DoubleSqueeze).

References:
    Renggli et al., "SparCML: High-Performance Sparse Communication for Machine Learning",
    SC 2019; Li and Hoefler, "Near-Optimal Sparse Allreduce for Distributed Deep Learning"
    (Ok-Topk), PPoPP 2022; Tang et al., "DoubleSqueeze: Parallel Stochastic Gradient Descent
    with Double-Pass Error-Compensated Compression", ICML 2019.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from gradzip.comm.base import Collective, allgather_wire_bytes, allreduce_wire_bytes
from gradzip.compressors.base import Job
from gradzip.ops.checks import check_on_device
from gradzip.ops.flat import reinterpret, to_device

__all__ = [
    "EXCHANGES", "SLACK", "ShardLayout", "by_form", "choose_exchange", "exchange_forms",
    "outside_own_part", "shard_layout", "sharded_reduce",
]

#: ``exchange`` settings of the sparsifiers: the cheapest form by the byte formulas
#: (``"auto"``), always the all-gather, or always the sharded exchange (with two workers or more).
EXCHANGES = ("auto", "allgather", "sharded")
#: Capacity of a part in the reduce-scatter, as a multiple of the entries a worker sends per
#: part on average (``kept / W``): room for selections that crowd into some parts.
SLACK = 2
_INT16_LIMIT = 32767


@dataclass(frozen=True)
class ShardLayout:
    """The fixed sizes of one tensor's sharded exchange (shapes and configuration only).

    Attributes:
        numel: the tensor's entries.
        world: the number of workers.
        part: entries per part, ``ceil(numel / world)``.
        capacity: entries per part in the reduce-scatter message.
        keep: entries an owner passes on in the all-gather (when sparse).
        index_bytes: bytes per index within a part (2 or 4).
    """

    numel: int
    world: int
    part: int
    capacity: int
    keep: int
    index_bytes: int

    @property
    def entry_bytes(self) -> int:
        """Bytes of one (value, index) entry."""
        return 4 + self.index_bytes

    @property
    def dense_back(self) -> bool:
        """Whether owners all-gather their part dense (fp32), being no more bytes."""
        return 4 * self.part <= self.keep * self.entry_bytes

    @property
    def scatter_bytes(self) -> int:
        """Bytes of one part's message in the reduce-scatter."""
        return self.capacity * self.entry_bytes

    @property
    def gather_bytes(self) -> int:
        """Bytes of one owner's message in the all-gather."""
        return 4 * self.part if self.dense_back else self.keep * self.entry_bytes

    @property
    def wire_bytes(self) -> int:
        """Wire bytes one worker sends for this tensor (both phases)."""
        return (self.world - 1) * (self.scatter_bytes + self.gather_bytes)


def shard_layout(numel: int, world: int, kept: int, owner_keep: int = 1) -> ShardLayout:
    """The layout of a tensor of ``numel`` entries among ``world`` workers whose compressor
    sends about ``kept`` entries per worker, owners passing on ``owner_keep * kept / W``
    entries of their part."""
    part = -(-numel // world)
    capacity = max(1, min(part, -(-SLACK * kept // world)))
    keep = max(1, min(part, -(-owner_keep * kept // world)))
    return ShardLayout(numel, world, part, capacity, keep, 2 if part < _INT16_LIMIT else 4)


# Cached: compressors ask once per tensor and call, with the same few arguments every step.
@lru_cache(maxsize=4096)
def choose_exchange(
    exchange: str, numel: int, world: int, kept: int, message_bytes: int, owner_keep: int = 1,
    sharded_ok: bool = True,
) -> str:
    """``"dense"``, ``"allgather"`` or ``"sharded"`` for one tensor.

    Decided from shapes, the number of workers and the configuration only (every argument is
    identical on every worker), so every worker takes the same branch and issues the same
    collectives.

    Args:
        exchange: the compressor's setting (:data:`EXCHANGES`).
        numel: the tensor's entries.
        world: the number of workers.
        kept: entries a worker sends (for a count that varies, the configured budget's).
        message_bytes: bytes of one worker's message in the all-gather form.
        owner_keep: what owners pass on, as a multiple of ``kept / W`` (:func:`shard_layout`).
        sharded_ok: whether the configuration allows the sharded form at all.

    Returns:
        Where ``exchange`` is ``"allgather"``, with one worker or where the sharded form is
        not allowed: the all-gather where it costs fewer wire bytes (payload bytes with one
        worker) than the dense fp32 all-reduce, else dense (the rule of
        :func:`~gradzip.compressors.base.sparse_pays`). Where it is ``"sharded"``: the
        sharded form. Else the fewest wire bytes of the three (ties keep the all-gather,
        then dense).
    """
    dense = allreduce_wire_bytes(4 * numel, world)
    gather = allgather_wire_bytes(message_bytes, world)
    if world == 1:
        pays = message_bytes < 4 * numel
    else:
        pays = gather < dense
    if exchange == "allgather" or world == 1 or not sharded_ok:
        return "allgather" if pays else "dense"
    if exchange == "sharded":
        return "sharded"
    best, cost = ("allgather", gather) if pays else ("dense", dense)
    if shard_layout(numel, world, kept, owner_keep).wire_bytes < cost:
        return "sharded"
    return best


def by_form(jobs: Sequence[Job], form_of: Callable[[int], str]) -> dict[str, list[Job]]:
    """The jobs grouped by exchange form (``"allgather"``, ``"dense"``, ``"sharded"``, in call
    order within each), ``form_of(numel)`` asked once per distinct size.

    Why: the form depends on a tensor's size and the configuration only, and a call's
    tensors share a few sizes (a network repeats its layers); pricing every tensor anew
    costs a few Python calls per tensor on every call.
    """
    groups: dict[str, list[Job]] = {"allgather": [], "dense": [], "sharded": []}
    known: dict[int, str] = {}
    for job in jobs:
        form = known.get(job.numel)
        if form is None:
            form = known[job.numel] = form_of(job.numel)
        groups[form].append(job)
    return groups


def exchange_forms(compressor: object, shapes: Mapping[str, torch.Size], world: int) -> dict[str, str]:
    """Which form each tensor travels by (``"dense"``, ``"allgather"``, ``"sharded"``) with
    ``world`` workers: a pure function of the shapes and the configuration, the same on every
    worker and every step.

    Args:
        compressor: a sparsifier with an ``exchange_for(numel, world)`` method.
        shapes: tensor name -> shape.
        world: the number of workers, >= 1.

    Raises:
        TypeError: ``compressor`` has no ``exchange_for``.
    """
    pick = getattr(compressor, "exchange_for", None)
    if pick is None:
        raise TypeError(
            f"`compressor` must be a sparsifier with `exchange_for`, got {type(compressor).__name__}"
        )
    return {name: pick(torch.Size(shape).numel(), world) for name, shape in shapes.items()}


def outside_own_part(flat: torch.Tensor, comm: Collective) -> torch.Tensor:
    """``flat[L, n]`` with each local worker's own part zeroed (a new tensor): what a worker
    selects from. Its own part travels whole to itself, and there holds the owner's residual
    (sums over workers, larger than any one worker's entries), which would otherwise take
    the places of the entries the worker sends to other owners."""
    workers, n = flat.shape
    part = -(-n // comm.world_size)
    out = flat.clone()
    for local, rank in enumerate(comm.local_ranks):
        out[local, rank * part : (rank + 1) * part] = 0.0
    return out


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    """``[..., m]`` -> ``[..., m * itemsize]`` uint8 (the same bytes)."""
    return x.contiguous().view(torch.uint8)


def _index_dtype(layout: ShardLayout) -> torch.dtype:
    return torch.int16 if layout.index_bytes == 2 else torch.int32


def _mark_unsent(values: torch.Tensor, indices: torch.Tensor, part: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries whose value is 0 become padding (index ``part``, value 0): sending a zero or not
    changes nothing, so "sent" is "non-zero" on both sides, with no count read on the host."""
    sent = values != 0
    return torch.where(sent, values, 0.0), torch.where(sent, indices, part)


def _zero_at(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``x[..., part]`` with the entries at ``indices`` (``part`` = padding) zeroed (new)."""
    wide = torch.nn.functional.pad(x, (0, 1))
    wide.scatter_(-1, indices, 0.0)
    return wide[..., :-1]


def _scatter_from_mask(x: torch.Tensor, mask: torch.Tensor, lay: ShardLayout,
                       rows: torch.Tensor, ranks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 1 from a mask: ``x`` ``[L, W, part]`` (padded), ``mask`` ``[L, numel]`` bool;
    returns each part's ``(values, indices)``, ``[L, W, capacity]`` each (padding marked)."""
    workers, world = x.shape[0], lay.world
    pad = lay.part * world - lay.numel
    chosen = torch.nn.functional.pad(mask.reshape(workers, -1), (0, pad)).reshape(x.shape)
    # A worker's own part is not sent: the owner adds it whole (it never travels).
    chosen[rows, ranks] = False
    picked = torch.where(chosen, x, 0.0).reshape(workers * world, lay.part)
    top = torch.topk(picked.abs(), lay.capacity, dim=1, sorted=False).indices
    values, indices = _mark_unsent(torch.gather(picked, 1, top), top, lay.part)
    return (values.reshape(workers, world, lay.capacity),
            indices.reshape(workers, world, lay.capacity))


def _scatter_from_picks(x: torch.Tensor, picks: torch.Tensor, lay: ShardLayout,
                        ranks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 1 from positions: ``picks`` ``[L, k]`` int64, each worker's selected positions
    in the tensor (distinct); the same parts' messages as :func:`_scatter_from_mask` of the
    mask they set, up to the order of the slots and ties at a part's capacity.

    Why: a worker selects ``k`` entries of ``n``; splitting them among the owners by sorting
    the ``k`` positions costs ``O(k log k)``, where masking the tensor and selecting each part's
    largest again passes over all ``n`` entries twice more."""
    workers, world, part, cap = x.shape[0], lay.world, lay.part, lay.capacity
    flat = x.reshape(workers, world * part)
    values = torch.gather(flat, 1, picks)
    owner = torch.div(picks, part, rounding_mode="floor")
    # By part, then by magnitude (descending) within a part: two stable sorts.
    by_size = values.abs().argsort(dim=1, descending=True, stable=True)
    by_part = owner.gather(1, by_size).argsort(dim=1, stable=True)
    order = by_size.gather(1, by_part)
    owner, values, picks = owner.gather(1, order), values.gather(1, order), picks.gather(1, order)
    # An entry's rank within its part: its position less where its part's run begins.
    starts = torch.searchsorted(owner, torch.arange(world, device=x.device).expand(workers, -1).contiguous())
    rank = torch.arange(picks.shape[1], device=x.device) - starts.gather(1, owner)
    # A worker's own part is not sent (the owner adds it whole); beyond capacity stays behind.
    sent = (rank < cap) & (owner != ranks[:, None])
    slot = torch.where(sent, owner * cap + rank, world * cap)  # one spare slot past the end
    out_val = torch.zeros(workers, world * cap + 1, dtype=torch.float32, device=x.device)
    out_idx = torch.full_like(out_val, part, dtype=torch.int64)
    out_val.scatter_(1, slot, torch.where(sent, values, 0.0))
    out_idx.scatter_(1, slot, torch.where(sent, picks - owner * part, part))
    got_val, got_idx = _mark_unsent(out_val[:, :-1], out_idx[:, :-1], part)
    return got_val.reshape(workers, world, cap), got_idx.reshape(workers, world, cap)


def sharded_reduce(jobs: Sequence[Job], selected: Sequence[torch.Tensor], kept: Sequence[int],
                   comm: Collective, owner_keep: int = 1) -> None:
    """Average every job through the sharded exchange and record every residual.

    Args:
        jobs: the tensors, in an order identical on every worker.
        selected: per job, the entries each local worker selected: ``[L, numel]`` bool, or
            ``[L, k]`` int64 distinct positions (a fixed count: Top-k's; the same exchange,
            from the ``k`` positions alone).
        kept: per job, the entries a worker sends on average (sizes the layout; identical on
            every worker).
        comm: the collective, with at least two workers.
        owner_keep: what owners pass on, as a multiple of ``kept / W``.

    Raises:
        ValueError: a received index lies outside its part (a corrupt message; checked on the
            device, see :mod:`gradzip.ops.checks`: on CUDA the device asserts instead).
    """
    if not jobs:
        return
    world, workers = comm.world_size, comm.local_workers
    layouts = [shard_layout(job.numel, world, k, owner_keep) for job, k in zip(jobs, kept, strict=True)]
    device = jobs[0].tensor.device
    # This process's workers' ranks: worker ``l`` owns part ``ranks[l]``.
    ranks = _ranks_on(tuple(comm.local_ranks), str(device))
    rows = torch.arange(workers, device=device)
    rests, own_parts, outgoing = [], [], []
    for job, chosen, lay in zip(jobs, selected, layouts, strict=True):
        pad = lay.part * world - lay.numel
        x = torch.nn.functional.pad(job.tensor.reshape(workers, -1).to(torch.float32), (0, pad))
        x = x.reshape(workers, world, lay.part)
        if chosen.dtype == torch.bool:
            values, indices = _scatter_from_mask(x, chosen, lay, rows, ranks)
        else:
            values, indices = _scatter_from_picks(x, chosen, lay, ranks)
        rests.append(_zero_at(x, indices))
        own_parts.append(x[rows, ranks])  # [L, part]
        outgoing += [_as_bytes(values), _as_bytes(indices.to(_index_dtype(lay)))]
    received = comm.all_to_all(torch.cat(outgoing, dim=2))  # [L, W senders, bytes]
    sums = _owner_sums(received, layouts, own_parts, comm)
    messages, residuals = [], []
    for lay, total in zip(layouts, sums, strict=True):
        if lay.dense_back:
            messages.append(_as_bytes(total))
            residuals.append(torch.zeros_like(total))
            continue
        top = torch.topk(total.abs(), lay.keep, dim=1, sorted=False).indices
        values, indices = _mark_unsent(torch.gather(total, 1, top), top, lay.part)
        messages += [_as_bytes(values), _as_bytes(indices.to(_index_dtype(lay)))]
        residuals.append(_zero_at(total, indices))
    gathered = comm.all_gather(torch.cat(messages, dim=1))  # [W owners, bytes]
    offset = 0
    for job, lay, rest, owner_rest in zip(jobs, layouts, rests, residuals, strict=True):
        offset, averaged = _decode_gathered(gathered, offset, lay)
        job.averaged = averaged.div_(world).reshape(job.shape)
        # The owner's residual goes where its part lies in its own worker's residual.
        rest[rows, ranks] = owner_rest
        job.keep(rest.reshape(workers, -1)[:, : lay.numel].reshape(job.tensor.shape))


def _owner_sums(received: torch.Tensor, layouts: Sequence[ShardLayout],
                own_parts: Sequence[torch.Tensor], comm: Collective) -> list[torch.Tensor]:
    """Each local worker's sum of its parts: ``[L, part]`` per job.

    The tensors' parts are laid end to end (each with one padding slot), so one scatter per
    sender covers the call; every entry still receives exactly its own additions, in rank
    order, so the bits do not depend on which tensors share the call.
    """
    workers, world = comm.local_workers, comm.world_size
    device = received.device
    values, indices, owns = [], [], []
    offset, start = 0, 0
    for lay, own in zip(layouts, own_parts, strict=True):
        size = lay.capacity
        values.append(reinterpret(received[:, :, offset : offset + 4 * size].reshape(
            workers * world, -1), torch.float32).reshape(workers, world, size))
        offset += 4 * size
        width = size * lay.index_bytes
        idx = reinterpret(received[:, :, offset : offset + width].reshape(workers * world, -1),
                          _index_dtype(lay)).to(torch.int64).reshape(workers, world, size)
        offset += width
        check_on_device(((idx >= 0) & (idx <= lay.part)).all(),
                        f"message indices must lie in their parts [0, {lay.part}]")
        indices.append(idx + start)
        owns.append(torch.nn.functional.pad(own, (0, 1)))
        start += lay.part + 1
    flat_val, flat_idx = torch.cat(values, dim=2), torch.cat(indices, dim=2)
    own_all = torch.cat(owns, dim=1)
    total = torch.zeros(workers, start, dtype=torch.float32, device=device)
    for sender in range(world):
        # Rank order on every worker and backend: the same additions, the same bits. A
        # worker's own slot holds only padding; its part is added whole at its own turn.
        total.scatter_add_(1, flat_idx[:, sender], flat_val[:, sender])
        local = sender - comm.first_rank
        if 0 <= local < workers:
            total[local] += own_all[local]
    out, start = [], 0
    for lay in layouts:
        out.append(total[:, start : start + lay.part])
        start += lay.part + 1
    return out


def _decode_gathered(gathered: torch.Tensor, offset: int, lay: ShardLayout) -> tuple[int, torch.Tensor]:
    """One job's summed tensor ``[numel]`` from every owner's message at ``offset``; returns
    the next offset. Each entry comes from one owner only: no order of addition to agree on."""
    world, part = lay.world, lay.part
    if lay.dense_back:
        size = 4 * part
        total = reinterpret(gathered[:, offset : offset + size], torch.float32).reshape(-1)
        return offset + size, total[: lay.numel].clone()
    size = lay.keep
    values = reinterpret(gathered[:, offset : offset + 4 * size], torch.float32)
    offset += 4 * size
    width = size * lay.index_bytes
    idx = reinterpret(gathered[:, offset : offset + width], _index_dtype(lay)).to(torch.int64)
    offset += width
    check_on_device(((idx >= 0) & (idx <= part)).all(),
                    f"message indices must lie in their parts [0, {part}]")
    owners = torch.arange(world, device=idx.device)[:, None]
    # Padding (index ``part``) lands in one spare slot past the end.
    flat = torch.where(idx == part, world * part, owners * part + idx)
    total = torch.zeros(world * part + 1, dtype=torch.float32, device=gathered.device)
    total.index_add_(0, flat.reshape(-1), values.reshape(-1))
    return offset, total[: lay.numel]


@lru_cache(maxsize=64)
def _ranks_on(ranks: tuple[int, ...], device: str) -> torch.Tensor:
    """int64 ``[L]``: this process's workers' ranks on ``device``, made once per group and
    device (a tensor made from a list on a GPU is a copy from pageable memory, which makes the
    host wait; this one is queued from page-locked memory, and only once)."""
    return to_device(torch.tensor(ranks, dtype=torch.int64), device)
