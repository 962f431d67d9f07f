"""What every compressor is: a frozen config plus pure functions over explicit state.

A compressor never holds mutable state itself. The engine owns a nested dict of plain data
(``init_state``), hands it to ``reduce`` and checkpoints it. Compressors *replace* entries of
that dict instead of writing into its tensors, which is what lets the engine roll a step back
cheaply (after a non-finite gradient) by restoring a shallow copy.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gradzip.comm.base import Collective, allgather_wire_bytes, allreduce_wire_bytes
from gradzip.feedback import residual_after
from gradzip.ops.flat import pack, split_flat, unpack, unpack_like

__all__ = ["Compressor", "Job", "SegmentPlan", "StepContext", "dense_reduce", "dense_tail",
           "gathered_or_dense_plan", "give_averages", "job_rows", "leftovers", "sparse_pays"]


@dataclass
class Job:
    """One tensor to reduce in one step.

    Attributes:
        name: the parameter's name (state is keyed by it).
        tensor: ``[L, *shape]`` float32, the error-compensated gradient of each local worker.
        averaged: filled by ``reduce``: ``[*shape]``, the average over all workers of what
            they sent, identical on every worker.
        decoded: filled by ``reduce`` (or left ``None``, see below): ``[L, *shape]``, what
            each local worker's own message decodes to.
        residual: ``[L, *shape]`` fp32, what error feedback keeps (``tensor - decoded``);
            recorded only by :meth:`keep`, never assigned.
        raw: ``[L, *shape]``, each local worker's gradient as it came, before error feedback
            added its residual (set by the engine; ``None`` where the caller has only
            ``tensor``). Read-only: controllers that judge the training regime use it.

    The residual contract (see :meth:`Compressor.reduce`): ``reduce`` sets ``decoded``, or
    records the residual with :meth:`keep` where it has it more cheaply, or both; error
    feedback reads :meth:`leftover`, which records ``tensor - decoded`` through :meth:`keep`
    when the compressor did not. Every residual thus passes through :meth:`keep`.
    """

    name: str
    tensor: torch.Tensor
    averaged: torch.Tensor | None = None
    decoded: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    raw: torch.Tensor | None = None

    def keep(self, residual: torch.Tensor) -> torch.Tensor:
        """Record what error feedback keeps of this job: ``tensor - decoded`` per local
        worker, ``[L, *shape]`` fp32. The one way a residual is recorded:
        :meth:`leftover` (from ``decoded``, by :func:`~gradzip.feedback.residual_after`),
        the threshold's one-pass split and :func:`~gradzip.compressors.sparse.gather_sparse`
        (by :func:`~gradzip.feedback.residual_unsent`) all call it.

        Returns:
            ``residual``.
        """
        assert residual.shape == self.tensor.shape and residual.dtype == torch.float32, (
            f"{self.name}: a residual must be float32 of shape {tuple(self.tensor.shape)}, "
            f"got {residual.dtype} {tuple(residual.shape)}")
        self.residual = residual
        return residual

    def own_decoded(self) -> torch.Tensor:
        """``[L, *shape]``: what each local worker's own message decodes to."""
        if self.decoded is not None:
            return self.decoded
        assert self.residual is not None, f"reduce left neither decoded nor residual: {self.name}"
        return self.tensor - self.residual

    def leftover(self) -> torch.Tensor:
        """``[L, *shape]``: what error feedback keeps, ``tensor - decoded`` (fp32), recorded
        through :meth:`keep` on first use when ``reduce`` left only ``decoded``."""
        if self.residual is not None:
            return self.residual
        assert self.decoded is not None, f"reduce left neither decoded nor residual: {self.name}"
        return self.keep(residual_after(self.tensor, self.decoded))

    #: ``[*shape]`` and its entry count, set once from ``tensor`` (which is never replaced).
    #: Why stored: compressors and the engine ask for them many times per tensor and step,
    #: and each computation is a slice of the shape and a product in Python; not from
    #: ``tensor[0]``, whose indexing makes a view (a few microseconds).
    shape: torch.Size = dataclasses.field(init=False, repr=False, compare=False)
    numel: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.shape = self.tensor.shape[1:]
        self.numel = math.prod(self.shape)


def leftovers(jobs: Sequence[Job]) -> list[torch.Tensor]:
    """Every job's :meth:`Job.leftover`, in order.

    Those that ``reduce`` left with ``decoded`` only get their ``tensor - decoded`` from one
    subtraction over the concatenations (see :func:`~gradzip.ops.flat.pack`: one launch on a
    GPU for a call, not one per tensor; elementwise the same subtraction), recorded through
    :meth:`Job.keep` as views of one buffer.
    """
    todo = [(j, j.decoded) for j in jobs if j.residual is None and j.decoded is not None]
    if len(todo) > 1 and all(j.tensor.dtype == d.dtype == torch.float32 for j, d in todo):
        whole = residual_after(pack([j.tensor for j, _ in todo]), pack([d for _, d in todo]))
        for (job, _), rest in zip(todo, unpack_like(whole, [j.tensor for j, _ in todo]),
                                  strict=True):
            job.keep(rest)
    return [j.leftover() for j in jobs]


@dataclass(frozen=True)
class SegmentPlan:
    """A compressor's form of a call whose tensors lie end to end in one row (see
    :meth:`Compressor.segment_plan`).

    Attributes:
        order: the call's tensors (indices into the engine's order) in the row's order: a
            compressor that treats some tensors apart (sent dense) puts them last, so that
            each kind is one slice of the row.
        data: what the compressor's :meth:`Compressor.reduce_segments` needs.
    """

    order: tuple[int, ...]
    data: Any


@dataclass(frozen=True)
class StepContext:
    """What a compressor may know about the step beyond the tensors.

    Attributes:
        step: optimizer steps completed before this one (0 on the first).
        ranks: global ranks of the local workers (used for per-worker randomness).
        world_size: number of workers in the group.
        lr: the optimizer's current learning rate, when the engine was given one.
    """

    step: int
    ranks: tuple[int, ...]
    world_size: int
    lr: float | None = None


class Compressor(ABC):
    """Base class of compression algorithms.

    Subclasses are frozen dataclasses whose fields are the configuration, validated in
    ``__post_init__``. Class attributes:

    * ``spec_name``: the name in spec strings (``"topk"`` in ``"topk:ratio=0.01"``).
    * ``biased``: whether error feedback is on by default.
    """

    spec_name: ClassVar[str] = ""
    biased: ClassVar[bool] = True
    #: spec-string key -> field name, for keys shorter than the field's name.
    spec_aliases: ClassVar[dict[str, str]] = {}
    #: ``reduce`` makes the host wait for no device work, the sizes of its collectives depend
    #: on the tensors' shapes only, and it accepts non-finite input (the result is then
    #: non-finite, never an error): the engine may then keep its non-finite decisions on
    #: the device (see :class:`~gradzip.Engine`).
    device_decisions: ClassVar[bool] = False

    def init_state(self, shapes: Mapping[str, torch.Size]) -> dict[str, Any]:
        """Fresh state for tensors of the given shapes (plain data and tensors only)."""
        return {}

    def init_group_state(
        self, shapes: Mapping[str, torch.Size], world_size: int, local_workers: int
    ) -> dict[str, Any]:
        """Fresh state for tensors of the given shapes reduced in a group of ``world_size``
        workers, ``local_workers`` of them in this process: what the engine calls. The same
        structure on every worker.

        A compressor whose state depends on the group (the owner residuals of the sharded
        quantised exchange, one shard per local worker) says so here; the default is
        :meth:`init_state`. ``reduce`` must also accept :meth:`init_state`'s state (a direct
        caller's), filling in what it lacks.

        Args:
            shapes: the tensors this compressor reduces.
            world_size: workers in the group (>= 1).
            local_workers: workers held by this process (the leading axis of per-worker
                tensors).

        Returns:
            Plain data and tensors only.
        """
        return self.init_state(shapes)

    @abstractmethod
    def reduce(
        self, jobs: Sequence[Job], state: dict[str, Any], comm: Collective, ctx: StepContext
    ) -> None:
        """Fill ``job.averaged`` for every job, and hand error feedback its residual.

        Residual contract (one for every compressor): for each job, either set ``job.decoded``
        (what each local worker's own message decodes to), or record the residual
        ``tensor - decoded`` with :meth:`Job.keep` where that is cheaper (a sparsifier: the
        tensor with the sent entries zeroed, :func:`~gradzip.feedback.residual_unsent`, no
        dense ``decoded`` built), or both (they must then agree exactly). Never assign
        ``job.residual``. Error feedback reads :meth:`Job.leftover`, which records
        ``tensor - decoded`` through :meth:`Job.keep` when no residual was recorded, so every
        residual passes through that one method and ``tensor == own_decoded + leftover`` per
        worker (the conformance suite checks this for every registered compressor). A
        residual is memory made in this call (a new tensor, ``job.tensor``, or a view of
        either), never a view of an older residual or of the state: the device path rolls a
        skipped step back by writing into the residuals the step made.

        Every worker must issue the same collectives with the same sizes, so any decision
        that shapes the exchange is taken from quantities identical on all workers.

        Finiteness contract (the engine relies on it to keep state finite): the engine hands
        only finite tensors, and tests ``job.averaged`` and the state afterwards, on every
        worker alike. A worker's own leftover (``tensor - decoded``) is tested nowhere, so it
        must be finite whenever the average is: either by construction (a sparsifier's
        residual is the tensor with entries zeroed; a sign or quantised message keeps each
        entry's sign and bounds its magnitude by the scale it sends), or the compressor makes
        a worker whose leftover overflows send a non-finite message (PowerSGD), so that the
        average of every worker turns non-finite too. State must be derived from aggregated
        quantities only, so it is identical on every worker.
        """

    def segment_plan(
        self, names: Sequence[str], sizes: Sequence[int], world_size: int, device: torch.device,
        shapes: Sequence[torch.Size] | None = None, *, state: Mapping[str, Any] | None = None,
    ) -> SegmentPlan | None:
        """This compressor's form of a call of tensors laid end to end in one row
        (:meth:`reduce_segments`), or ``None`` where it has none for such a call (the
        default: the engine then calls :meth:`reduce`).

        The engine asks once per layout of a DDP bucket and per value of
        :meth:`segment_key`, and keeps the answer, so it must depend on the arguments, the
        configuration and what :meth:`segment_key` reads of the state only (every worker
        gets the same).

        Args:
            names: the tensors' names, in the engine's order (what keys a random draw).
            sizes: their entries.
            world_size: workers in the group.
            device: where the tensors are.
            shapes: their shapes, where the caller knows them (the engine does; a form that
                needs them, as PowerSGD's matrices do, has none without them).
            state: the compressor's state, for a form that depends on it (a two-level
                controller's levels decide which matrices share a group).
        """
        return None

    def segment_key(self, state: Mapping[str, Any]) -> Hashable:
        """What of ``state`` :meth:`segment_plan` depends on: the engine asks for a new plan
        when it changes (``None``, the default: nothing, the plan holds for good). Called
        at every call that may take the segment path, so it must be cheap."""
        return None

    def reduce_segments(
        self, flat: torch.Tensor, plan: SegmentPlan, state: dict[str, Any], comm: Collective,
        ctx: StepContext, raw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`reduce` of a call whose compensated tensors lie end to end in one row, in
        ``plan.order``: the same collectives, bytes and bits, without a :class:`Job` per
        tensor.

        Called by the engine only with a ``plan`` :meth:`segment_plan` gave for this call's
        sizes. ``flat`` (``[1, N]`` float32, made in the call) is overwritten with the
        residuals (each tensor's ``tensor - decoded``, what :meth:`Job.keep` would record);
        the return value is the ``[N]`` average in the same order (a new tensor). ``raw``,
        where given, is the row's compressed part before error feedback (``[1, C]``, what
        :attr:`Job.raw` holds per tensor; read only, and before ``flat`` is written: without
        error feedback it is ``flat`` itself), for compressors that judge the gradients as
        they came (Accordion). Every contract of :meth:`reduce` holds.
        """
        raise NotImplementedError(f"{type(self).__name__} has no segment form")

    def check_state(
        self,
        state: Mapping[str, Any],
        *,
        fresh: Mapping[str, Any],
        shapes: Mapping[str, torch.Size],
        workers: int,
    ) -> str | None:
        """The first value of a loaded state this compressor could not continue from.

        Called by ``Engine.load_state_dict`` after the state's structure, shapes, dtypes,
        kinds of values and finiteness were checked against ``fresh``; this checks what
        those cannot: ranges, names and consistency (a negative counter, an unknown level).
        Nothing is changed.

        Args:
            state: the loaded state (same structure as ``fresh``).
            fresh: this compressor's ``init_state`` for the same tensors.
            shapes: the tensors this compressor reduces.
            workers: the local workers (the leading axis of per-worker tensors).

        Returns:
            ``"path: what it must be, got value"``, or ``None`` when the state is usable.
        """
        return None

    def upgrade_state(self, state: Any, *, fresh: Mapping[str, Any], step: int) -> Any:
        """A loaded state in an earlier version's layout, brought to this one's (before the
        engine checks it against ``fresh``); any other state unchanged. Never mutates
        ``state``.

        Args:
            state: the loaded state, as found in the checkpoint (not yet validated).
            fresh: this compressor's fresh state for the engine loading it.
            step: the engine's step count recorded in the checkpoint.

        Returns:
            The state in the current layout (``state`` itself where nothing changes).
        """
        return state

    def host_call(self, state: Mapping[str, Any], ctx: StepContext, *, finish_step: bool) -> bool:
        """Whether the next call must read its non-finite decision on the host: it will change
        a plain (non-tensor) value of ``state``, which a device rollback cannot undo (a
        controller's decision). Only consulted for compressors with ``device_decisions``;
        decided from ``state`` and ``ctx``, identical on every worker, so every worker takes
        the same path.

        Args:
            state: this compressor's state before the call.
            ctx: the call's step context.
            finish_step: whether the call completes the optimizer step (``end_step`` runs in it).

        Returns:
            ``False`` by default.
        """
        return False

    def begin_step(self, state: dict[str, Any], comm: Collective, ctx: StepContext) -> None:
        """Called once per optimizer step, before its first call and before the engine notes
        where the step began: what it changes is not undone when the step is rolled back (a
        skipped step leaves it standing, as it leaves the optimizer's learning rate).

        A controller takes its decisions here so that the step's calls change tensors only
        and may keep their non-finite decisions on the device. It may issue collectives
        (every rank calls it at the same point of the same step) and read on the host; it
        must raise before changing ``state``, if at all. Nothing by default.
        """
        return None

    def end_step(self, state: dict[str, Any], ctx: StepContext) -> None:
        """Called once per optimizer step, after every tensor of the step was reduced.

        Stateless compressors have nothing to do here; adaptive ones update their controllers.
        """
        return None

    def tensor_levels(self, state: Mapping[str, Any]) -> dict[str, str] | None:
        """Each tensor's compression level in ``state``, for a compressor that switches tensors
        between levels (a controller), else ``None``.

        Read by the engine's compression-error meter after a call's ``reduce`` and before
        ``end_step``, so the levels are those the call's tensors were reduced at.

        Args:
            state: this compressor's state.

        Returns:
            ``name -> "critical" | "steady" | "dense"``, or ``None`` (the default: one level).
        """
        return None

    def report(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """What a training log records about this compressor, from its state.

        The one way a training loop learns about a compressor: it asks, and never inspects
        types or state keys. Every key is optional:

        * ``density``: fraction of gradient entries sent, where the configuration fixes it.
        * ``density_parts``: ``(sent, offered)``, cumulative since the start, where it varies
          (density over a span = difference of ``sent`` / difference of ``offered``).
        * ``levels``: ``tensor name -> level`` for the next step (controllers).
        * ``counts``: a controller's cumulative counts (``decisions``, ``critical_steps``,
          ``steady_steps``, ...); a compressor reporting them offers
          ``decisions(state, since)`` for its decision records.

        Args:
            state: this compressor's state (``engine.compressor_state``).

        Returns:
            Plain data (numbers, strings, dicts of them); empty by default.
        """
        return {}

    def spec(self) -> str:
        """The spec string that rebuilds this compressor."""
        key_of = {field: key for key, field in self.spec_aliases.items()}
        fields = [
            f"{key_of.get(f.name, f.name)}={getattr(self, f.name)}"
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if getattr(self, f.name) != f.default or f.name in key_of
        ]
        return self.spec_name + (":" + ",".join(fields) if fields else "")

    def __str__(self) -> str:
        return self.spec()


def dense_reduce(jobs: Sequence[Job], comm: Collective) -> None:
    """Exact average of every job's tensor with one all-reduce of one flat buffer."""
    if not jobs:
        return
    total = comm.all_reduce_cat([j.tensor for j in jobs]) / comm.world_size
    give_averages(jobs, total)
    for job in jobs:
        job.decoded = job.tensor


def dense_tail(flat: torch.Tensor, start: int, comm: Collective) -> torch.Tensor:
    """A segment row's tensors sent dense (``flat[:, start:]``, see
    :meth:`Compressor.reduce_segments`), as :func:`dense_reduce` sends them: their exact
    average by one all-reduce, their residual ``tensor - decoded`` (zero) written into
    ``flat``. Returns a new ``[N]`` row for the call's averages, this tail's filled."""
    average = torch.empty(flat.shape[1], dtype=torch.float32, device=flat.device)
    dense = flat[:, start:]
    if dense.numel():
        torch.div(comm.all_reduce_cat([dense]), comm.world_size, out=average[start:])
        dense.sub_(dense)  # decoded is the tensor itself: elementwise ``tensor - decoded``
    return average


def gathered_or_dense_plan(
    forms: Sequence[str], sizes: Sequence[int], make: Callable[[list[int]], Any],
    most: int | None = None,
) -> SegmentPlan | None:
    """The segment plan of a compressor whose tensors travel in one message (``forms[i]``
    ``"allgather"``) or dense (``"dense"``); any other form has no segment form (``None``),
    nor does a message of more than ``most`` entries (where its ordinary form would cut the
    call in pieces: flat positions that must fit int32). The row holds the first kind, then
    the dense tensors, each kind in order; the plan's data is ``(make(the first kind's
    indices), their entries)``, ``None`` in place of the first where every tensor is dense."""
    gathered = [i for i, form in enumerate(forms) if form == "allgather"]
    dense = [i for i, form in enumerate(forms) if form == "dense"]
    if not forms or len(gathered) + len(dense) != len(forms):
        return None
    count = sum(sizes[i] for i in gathered)
    if most is not None and count > most:
        return None
    return SegmentPlan(tuple(gathered + dense), (make(gathered) if gathered else None, count))


def give_averages(jobs: Sequence[Job], total: torch.Tensor) -> None:
    """Set every job's ``averaged`` to its part of ``total`` ``[N]`` (the jobs' averages
    end to end), in the job's shape: views made in one call where ``total`` is contiguous
    (see :func:`~gradzip.ops.flat.unpack`: no Python call per tensor on the hot path), else
    what a ``reshape`` of each part gives."""
    if total.dim() == 1 and total.is_contiguous():
        parts = unpack(total, [job.shape for job in jobs])
    else:
        parts = [part.reshape(job.shape)
                 for job, part in zip(jobs, split_flat(total, [j.numel for j in jobs]), strict=True)]
    for job, part in zip(jobs, parts, strict=True):
        job.averaged = part


def job_rows(jobs: Sequence[Job], rows: torch.Tensor) -> list[torch.Tensor]:
    """Each job's part of ``rows`` ``[L, N]`` (the jobs' entries end to end in every row),
    in the job's ``[L, *shape]``: views made in one call where ``rows`` is one contiguous
    row (a real process group; see :func:`~gradzip.ops.flat.unpack_like`), else what a
    ``reshape`` of each column block gives (a copy where ``L > 1``)."""
    if rows.shape[0] == 1 and rows.is_contiguous():
        return unpack_like(rows.view(-1), [job.tensor for job in jobs])
    return [part.reshape(job.tensor.shape)
            for job, part in zip(jobs, split_flat(rows, [j.numel for j in jobs]), strict=True)]


def sparse_pays(numel: int, sent: int, entry_bytes: int, comm: Collective) -> bool:
    """Whether all-gathering ``sent`` entries of ``entry_bytes`` each per worker costs less
    than all-reducing the dense fp32 tensor.

    Compared on wire bytes; with one worker (no wire) on payload bytes. Depends only on
    arguments identical on every worker, so every worker takes the same branch.
    """
    sparse, dense = sent * entry_bytes, numel * 4
    if comm.world_size == 1:
        return sparse < dense
    return allgather_wire_bytes(sparse, comm.world_size) < allreduce_wire_bytes(
        dense, comm.world_size
    )
