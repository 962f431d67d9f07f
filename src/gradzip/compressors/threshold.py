"""Hard-threshold sparsification: send every entry whose magnitude reaches lambda."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gradzip._validate import check_bool, check_choice, check_int, check_real
from gradzip.comm.base import Collective, allreduce_wire_bytes
from gradzip.compressors.base import (
    Compressor,
    Job,
    SegmentPlan,
    StepContext,
    dense_reduce,
    dense_tail,
)
from gradzip.compressors.sharded_sparse import (
    EXCHANGES,
    by_form,
    choose_exchange,
    outside_own_part,
    shard_layout,
    sharded_reduce,
)
from gradzip.compressors.sparse import index_bytes, positions_plan
from gradzip.compressors.threshold_capacity import gather_row, reduce_capacity
from gradzip.compressors.threshold_law import next_lambda
from gradzip.compressors.threshold_sized import reduce_sized
from gradzip.ops.flat import cat_rows, to_device
from gradzip.ops.select import topk_abs

__all__ = ["HardThreshold"]

_COUNTERS = ("sent", "offered", "step_sent", "step_offered")
_FORMS = ("allgather", "sharded", "dense")


@dataclass(frozen=True)
class HardThreshold(Compressor):
    """Send every entry with ``|g + residual| >= lam``; error feedback keeps the rest.

    One constant threshold over the whole model, and the density varies by step and by worker
    (high early in training, tiny late). Two all-gather forms:

    * **Exchanged sizes** (the default: no ``capacity``): workers first exchange how many
      entries each tensor sends (4 bytes per tensor, read on the host once per call), then
      all-gather values and int32 indices padded to the densest worker; a tensor whose densest
      worker would cost more than a dense all-reduce goes dense. The message's size follows
      the entries that pass lambda (dense early in training, tiny late), which is the paper's
      point: the bytes adapt, with nothing sent that did not pass. The price is one host wait
      per call, so the engine decides on the host.
    * **Fixed capacity** (``capacity`` given): each worker's message holds
      ``capacity * numel`` slots per tensor (values and int32 positions), sized from shapes
      alone, so no worker reads a count on the host and, with ``lam``, the engine decides on
      the device (the GPU form, no host wait). A worker sends exactly its entries at or above
      lambda when they fit; when a tensor has more, it sends the largest of them and the rest
      stay in its error-feedback residual (sent later, nothing lost, but delayed). Free slots
      travel as padding (value 0), so the bytes no longer shrink when few entries pass lambda:
      every step carries the capacity. A tensor whose capacity costs more than a dense
      all-reduce goes dense.

    Exactly one of ``lam`` and ``budget`` is given:

    * ``lam``: the absolute threshold of the paper (> 0).
    * ``budget``: the target *average density over the run*, in (0, 1]. The first step sets
      lambda to the mean over workers of each worker's ``(1 - budget)`` magnitude quantile;
      after every step lambda is multiplied by
      ``(recent_density / budget) ** 0.3 * (run_density / budget) ** 0.3`` (clamped to
      [1/1.25, 1.25]), where ``recent_density`` is a moving average of step densities (weight
      0.05 on the newest step) and densities count the entries all workers sent. Both are
      identical on every worker, so every worker keeps the same lambda. Early steps overshoot
      (error feedback makes residuals grow past the first step's quantile); the run-density
      term pays that back, so the run's average density converges to the budget.

    With ``padded=True`` (budget mode only) the density counts what the wire carries: every
    worker ships as many entries as the densest worker of each tensor, so the budget then
    bounds the *padded* volume and the bytes match a Top-k of ``ratio=budget`` (plus 4 bytes
    of sizes per tensor), at the price of a higher lambda than ``padded=False`` needs.

    In budget mode (not padded), where it costs fewer wire bytes (from about three workers
    on), a tensor travels by the sharded exchange instead (:mod:`gradzip.compressors.sharded_sparse`):
    lambda keeps its meaning (a worker offers exactly its entries at or above lambda outside
    its own part), but each part's owner receives at most ``2 * budget * numel / W`` of them
    from each worker (the largest; the rest stay in the worker's residual) and passes on the
    largest ``owner_keep * budget * numel / W`` entries of its part's sum (the rest stay in
    its own residual). The budget's density then counts entries offered out of the
    ``(W - 1) * numel`` outside the workers' own parts.
    Message sizes then follow from shapes and the budget alone; the entries offered are
    still counted for the budget, with one all-reduce of the counts per call (read on the
    host, as the all-gather form reads its sizes). The absolute ``lam`` mode has no budget
    to size the parts and always all-gathers.

    With ``exchange="auto"`` (budget, no ``padded``, no ``capacity``) the form is chosen at
    every call from that call's counts: every worker counts its entries at or above lambda in
    each tensor (and in its own part), one all-reduce sums the counts, and the all-gather is
    priced at the mean count per worker (what passes lambda varies by step: with error
    feedback early steps pass several times the budget, late ones less). A tensor's form may
    thus change from step to step; ``report()["exchange"]`` counts the tensor-calls of each
    form since the start (part of the state, so a resumed run continues the count).

    Args:
        lam: the absolute threshold (> 0), or ``None`` with ``budget``.
        budget: the target run density in (0, 1], or ``None`` with ``lam``.
        padded: count the padded volume against the budget (budget mode only).
        capacity: slots per tensor of the fixed-capacity form, as a fraction of its entries,
            in (0, 1] (e.g. 0.05); ``None`` (the default): the exchanged-sizes form.
        exchange: ``"auto"``, ``"allgather"`` or ``"sharded"`` (the last needs ``budget``
            without ``padded``); see :data:`~gradzip.compressors.sharded_sparse.EXCHANGES`.
        owner_keep: in the sharded exchange, what each owner passes on, as a multiple of
            ``budget * numel / W`` (an integer >= 1).

    References:
        Sahu et al., "Rethinking gradient sparsification as total error minimization",
        NeurIPS 2021.
    """

    lam: float | None = None
    budget: float | None = None
    padded: bool = False
    capacity: float | None = None
    exchange: str = "auto"
    owner_keep: int = 4
    spec_name: ClassVar[str] = "threshold"

    def __post_init__(self) -> None:
        if (self.lam is None) == (self.budget is None):
            raise ValueError(
                f"exactly one of `lam` and `budget` must be given, got lam={self.lam!r}, "
                f"budget={self.budget!r}"
            )
        if self.lam is not None:
            object.__setattr__(self, "lam", check_real("lam", self.lam, low=0, low_open=True))
        if self.budget is not None:
            object.__setattr__(
                self, "budget", check_real("budget", self.budget, low=0, high=1, low_open=True)
            )
        check_bool("padded", self.padded)
        if self.capacity is not None:
            object.__setattr__(self, "capacity", check_real("capacity", self.capacity, low=0,
                                                            high=1, low_open=True))
        if self.padded and self.budget is None:
            raise ValueError(f"`padded` needs `budget` (it shapes the budget), got lam={self.lam!r}")
        object.__setattr__(self, "exchange", check_choice("exchange", self.exchange, EXCHANGES))
        object.__setattr__(self, "owner_keep", check_int("owner_keep", self.owner_keep, minimum=1))
        if self.exchange == "sharded" and (self.budget is None or self.padded):
            raise ValueError(
                "`exchange` 'sharded' needs `budget` without `padded` (the budget sizes the "
                f"parts), got lam={self.lam!r}, padded={self.padded!r}"
            )

    def exchange_for(self, numel: int, world: int, sent: int | None = None) -> str:
        """How a tensor of ``numel`` entries travels among ``world`` workers: ``"dense"``,
        ``"allgather"`` or ``"sharded"``.

        Args:
            numel: the tensor's entries.
            world: the number of workers.
            sent: entries per worker the sized all-gather is priced at (the step's mean
                count, identical on every worker); ``None``: the budget's (before any count
                is known). Ignored with a ``capacity`` (the slots price it).

        Returns:
            The form. In the sized form, ``"allgather"`` may still send a tensor dense when
            its densest worker's count makes that cheaper.
        """
        if self.fixed_capacity:
            per, extra = self.slots_for(numel), 0
        else:  # the sized form also all-gathers its count (4 bytes)
            per, extra = self._kept(numel) if sent is None else sent, 4
        return choose_exchange(self.exchange, numel, world, self._kept(numel),
                               per * (4 + index_bytes(numel)) + extra, self.owner_keep,
                               sharded_ok=self.budget is not None and not self.padded)

    @property
    def chooses_by_count(self) -> bool:
        """Whether each call chooses its tensors' forms from the call's all-reduced counts
        (``exchange="auto"`` with a budget, without ``padded`` or ``capacity``)."""
        return (self.exchange == "auto" and self.budget is not None and not self.padded
                and not self.fixed_capacity)

    def slots_for(self, numel: int) -> int:
        """Entries one worker's all-gathered message holds for a tensor of ``numel`` entries:
        ``capacity * numel`` (at least one, at most ``numel``)."""
        if self.capacity is None:
            raise ValueError(f"`capacity` must be given for slots, got {self.capacity!r}")
        return max(1, min(numel, int(self.capacity * numel)))

    @property
    def fixed_capacity(self) -> bool:
        """Whether the all-gather carries ``capacity`` slots per tensor (``capacity`` given),
        else exact sizes exchanged first (the default)."""
        return self.capacity is not None

    @property
    def device_decisions(self) -> bool:  # type: ignore[override]
        """``lam`` with ``capacity``: the step's work reads nothing on the host (message sizes
        from shapes, counters kept on the device). The exchanged-sizes form reads its counts
        on the host once per call, and a budget's control law reads the step's density, so
        both keep host decisions."""
        return self.budget is None and self.capacity is not None

    def _kept(self, numel: int) -> int:
        """Entries per worker the budget allows in a tensor of ``numel`` (1 with ``lam``)."""
        return max(1, min(numel, int((self.budget or 0.0) * numel)))

    def init_state(self, shapes: Mapping[str, torch.Size]) -> dict[str, Any]:
        # lam < 0 marks "not calibrated yet" in budget mode; recent < 0 "no step seen yet".
        # The exchanged-sizes form reads its counts on the host anyway: its counters are
        # integers. With a capacity they are 0-d float64 tensors (exact integers up to 2**53)
        # that stay where the messages are, so a step reads nothing on the host to count.
        counters: dict[str, Any] = (
            {key: torch.zeros((), dtype=torch.float64) for key in _COUNTERS}
            if self.fixed_capacity else dict.fromkeys(_COUNTERS, 0)
        )
        state = {"lam": float(self.lam) if self.lam is not None else -1.0, "recent": -1.0,
                 **counters}
        if not self.fixed_capacity:
            # Tensor-calls per form since the start: in the sized form the form depends on
            # the step's counts (read on the host there anyway), so it is counted, not
            # derived from shapes.
            state["exchange"] = dict.fromkeys(_FORMS, 0)
        return state

    def upgrade_state(self, state: Any, *, fresh: Mapping[str, Any], step: int) -> Any:
        """A sized form's state saved before its forms were counted gains zero counts."""
        if (isinstance(state, Mapping) and "exchange" in fresh and "exchange" not in state
                and set(state) == set(fresh) - {"exchange"}):
            return {**state, "exchange": dict.fromkeys(_FORMS, 0)}
        return state

    def _calibrate(self, jobs: Sequence[Job], comm: Collective) -> float:
        assert self.budget is not None
        flat = cat_rows([j.tensor for j in jobs], comm.local_workers)
        keep = max(1, min(flat.shape[1], int(self.budget * flat.shape[1])))
        # The keep-th largest magnitude of each worker (exact; topk_abs avoids a full sort).
        local = topk_abs(flat, keep)[0].abs().min(dim=1).values
        lam = float(comm.all_reduce(local.reshape(-1, 1)).item()) / comm.world_size
        return lam if lam > 0 else float(torch.finfo(torch.float32).tiny)

    def reduce(
        self, jobs: Sequence[Job], state: dict[str, Any], comm: Collective, ctx: StepContext
    ) -> None:
        if not jobs:
            return
        # Nothing to calibrate on while every tensor is empty (same on every rank: shapes
        # are agreed); empty tensors select nothing whatever lambda is.
        if state["lam"] < 0 and any(j.numel for j in jobs):
            state["lam"] = self._calibrate(jobs, comm)
        lam = state["lam"]
        if self.chooses_by_count and comm.world_size > 1:
            forms, offered = self._choose_by_count(jobs, lam, comm)
        else:
            forms, offered = self._choose_by_shape(jobs, comm.world_size), None
        dense = 0
        if forms["sharded"]:
            self._reduce_sharded(forms["sharded"], lam, state, comm, offered)
        dense_reduce(forms["dense"], comm)
        if forms["allgather"] and not self.fixed_capacity:
            # The default: exact sizes exchanged first, so the message follows what passes
            # lambda (the counts are read on the host once per call, the same on every rank).
            sent, total, dense = reduce_sized(forms["allgather"], lam, self.padded, comm)
            _count(state, sent, total)
        elif forms["allgather"]:
            _count(state, *reduce_capacity(forms["allgather"], lam, self.slots_for, self.padded,
                                           comm))
        if "exchange" in state:
            taken = {"allgather": len(forms["allgather"]) - dense, "sharded": len(forms["sharded"]),
                     "dense": len(forms["dense"]) + dense}
            state["exchange"] = {f: state["exchange"][f] + taken[f] for f in _FORMS}

    def segment_plan(
        self, names: Sequence[str], sizes: Sequence[int], world_size: int, device: torch.device,
        shapes: Sequence[torch.Size] | None = None, *, state: Mapping[str, Any] | None = None,
    ) -> SegmentPlan | None:
        """With ``lam`` and a ``capacity`` (the form whose decisions stay on the device): the
        row's order (the all-gathered tensors, then those sent dense, each kind in the
        engine's order, as :meth:`reduce` groups them) and the slots' layout, where the
        all-gathered tensors' flat positions fit in one piece (see
        :meth:`~gradzip.compressors.base.Compressor.segment_plan`); else ``None``."""
        if not self.device_decisions:
            return None

        return positions_plan([self.exchange_for(n, world_size) for n in sizes], sizes,
                              self.slots_for, device)

    def reduce_segments(
        self, flat: torch.Tensor, plan: SegmentPlan, state: dict[str, Any], comm: Collective,
        ctx: StepContext, raw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`reduce` on tensors already laid end to end (see
        :meth:`~gradzip.compressors.base.Compressor.reduce_segments`): the dense tensors'
        all-reduce first, then the fixed-capacity all-gather of the others, counted as
        :meth:`reduce` counts it; the same averages and state."""
        layout, count = plan.data
        average = dense_tail(flat, count, comm)
        if layout is not None:
            total, sent = gather_row(flat[:, :count], layout, state["lam"], self.padded, comm)
            torch.div(total, comm.world_size, out=average[:count])
            _count(state, sent, comm.world_size * count)
        return average

    def _choose_by_shape(self, jobs: Sequence[Job], world: int) -> dict[str, list[Job]]:
        def form_of(numel: int) -> str:
            # From sizes and configuration only: the same form on every worker.
            form = self.exchange_for(numel, world)
            if form == "dense" and not self.fixed_capacity:
                return "allgather"  # the sized form chooses dense from the counts it learns
            return form

        return by_form(jobs, form_of)

    def _choose_by_count(self, jobs: Sequence[Job], lam: float, comm: Collective
                         ) -> tuple[dict[str, list[Job]], dict[str, int]]:
        """Each tensor's form from the call's counts, and the entries offered outside the
        workers' own parts per tensor (what the sharded form counts against the budget)."""
        workers, world = comm.local_workers, comm.world_size
        # Only a tensor whose sharded form costs less than its dense all-reduce can go sharded
        # (the sized all-gather goes dense beyond that): the others take the sized form with
        # no count here, and a call with none of the first kind exchanges nothing more.
        forms = self._choose_by_shape([j for j in jobs if not self._may_shard(j.numel, world)],
                                      world)
        open_jobs = [j for j in jobs if self._may_shard(j.numel, world)]
        if not open_jobs:
            return forms, {}
        counts = []
        for job in open_jobs:
            above = job.tensor.reshape(workers, -1).abs() >= lam  # NaN never reaches lambda
            part = -(-job.numel // world)
            own = torch.stack([above[w, r * part : (r + 1) * part].sum()
                               for w, r in enumerate(comm.local_ranks)])
            counts += [above.sum(dim=1), own]
        # The decision must be the same on every worker (each takes its own collectives for
        # each form), so it is taken from the counts summed over the group by one all-reduce
        # (identical everywhere, read on the host once per call), never from a worker's own
        # count. The all-gather pads to its densest worker: priced at the mean count, a lower
        # bound, the sharded form is taken only where it is cheaper even so.
        sums = comm.all_reduce(torch.stack(counts, dim=1)).tolist()
        offered: dict[str, int] = {}
        for t, job in enumerate(open_jobs):
            whole, own = int(sums[2 * t]), int(sums[2 * t + 1])
            form = self.exchange_for(job.numel, world, sent=-(-whole // world))
            forms["allgather" if form == "dense" else form].append(job)
            offered[job.name] = whole - own
        # Every form keeps the call's order of tensors (the collectives' order on every worker).
        order = {j.name: i for i, j in enumerate(jobs)}
        return {f: sorted(js, key=lambda j: order[j.name]) for f, js in forms.items()}, offered

    def _may_shard(self, numel: int, world: int) -> bool:
        """Whether a tensor of ``numel`` entries may take the sharded form at some count: its
        sharded bytes are below its dense all-reduce's (shapes and configuration only)."""
        lay = shard_layout(numel, world, self._kept(numel), self.owner_keep)
        return numel > 0 and lay.wire_bytes < allreduce_wire_bytes(4 * numel, world)

    def _reduce_sharded(self, jobs: Sequence[Job], lam: float, state: dict[str, Any],
                        comm: Collective, offered: Mapping[str, int] | None = None) -> None:
        workers = comm.local_workers
        # NaN never reaches lambda. A worker's own part travels whole to itself (it holds the
        # owner's residual there): it offers entries of the other parts only.
        masks = [outside_own_part(j.tensor.reshape(workers, -1), comm).abs() >= lam for j in jobs]
        # What the budget counts: every worker's entries at or above lambda, summed over the
        # group (identical on every worker, so lambda stays the same everywhere), out of the
        # entries outside each worker's own part ((W - 1) n in all: the parts tile a tensor).
        # ``offered``: those sums, already learnt with the choice of forms.
        total = (comm.all_reduce(torch.stack([m.sum(dim=1) for m in masks], dim=1)).sum(
            dtype=torch.float64) if offered is None else sum(offered[j.name] for j in jobs))
        _count(state, total, (comm.world_size - 1) * sum(j.numel for j in jobs))
        sharded_reduce(jobs, masks, [self._kept(j.numel) for j in jobs], comm, self.owner_keep)

    def report(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Entries sent and offered by all workers since the start (completed steps; a host
        read of two counters) and, in the sized form, the tensor-calls of each exchange form
        (``"exchange"``)."""
        if "sent" not in state:
            return {}
        out: dict[str, Any] = {"density_parts": (int(state["sent"]), int(state["offered"]))}
        if "exchange" in state:
            out["exchange"] = {f: n for f, n in state["exchange"].items() if n}
        return out

    def check_state(self, state: Mapping[str, Any], *, fresh: Mapping[str, Any],
                    shapes: Mapping[str, torch.Size], workers: int) -> str | None:
        """``lam`` this configuration's (``lam`` given) or > 0 (``-1.0`` before a budget's
        first step); ``recent`` a density or ``-1.0``; counters whole numbers >= 0,
        ``sent <= offered``, none pending between steps (see ``Compressor.check_state``)."""
        lam, recent = state["lam"], state["recent"]
        if self.lam is not None and lam != float(self.lam):
            return f"lam: must be {float(self.lam)!r} (this compressor's `lam`), got {lam!r}"
        if self.budget is not None and not (lam > 0 or lam == -1.0):
            return f"lam: must be > 0 (or -1.0 before the first step), got {lam!r}"
        if not (recent == -1.0 or 0 <= recent <= 1):
            return f"recent: must be in [0, 1] (or -1.0 before the first step), got {recent!r}"
        for key in _COUNTERS:
            value = float(state[key])
            if value < 0 or value != int(value) or (key.startswith("step_") and value != 0):
                want = "0 between steps" if key.startswith("step_") else "a whole number >= 0"
                return f"{key}: must be {want}, got {value!r}"
        if float(state["sent"]) > float(state["offered"]):
            return f"sent: must be <= offered ({float(state['offered'])!r}), got {float(state['sent'])!r}"
        for form, count in state.get("exchange", {}).items():
            if form not in _FORMS or not isinstance(count, int) or count < 0:
                return f"exchange.{form}: must be a form of {_FORMS} with a count >= 0, got {count!r}"
        return None

    def end_step(self, state: dict[str, Any], ctx: StepContext) -> None:
        state["sent"] = state["sent"] + state["step_sent"]
        state["offered"] = state["offered"] + state["step_offered"]
        step_sent = step_offered = 0.0
        if self.budget is not None:
            # The control law reads the step's counts (one host read a step, at its end, when
            # they are tensors).
            step_sent, step_offered = float(state["step_sent"]), float(state["step_offered"])
        if self.budget is not None and step_offered > 0:
            state["recent"], state["lam"] = next_lambda(
                state["lam"], state["recent"], step_sent / step_offered,
                float(state["sent"]) / float(state["offered"]), self.budget)
        state["step_sent"] = state["step_sent"] * 0
        state["step_offered"] = state["step_offered"] * 0


def _count(state: dict[str, Any], sent: torch.Tensor | int, offered: int) -> None:
    """Add a call's entries sent and offered (from shapes) to the step's counters (new
    values: state is replaced, never written into). With tensor counters (a capacity) ``sent``
    stays a 0-d tensor on the messages' device (no host read); with integer counters (the
    exchanged-sizes form, which reads its counts on the host anyway) it is read as an int."""
    if isinstance(state["step_sent"], torch.Tensor):
        state["step_sent"] = state["step_sent"] + sent
        # Both counters follow the messages to their device at the first call (queued, no
        # host wait): a CPU counter beside a GPU one would split the step's finiteness test
        # of the state across devices.
        device = state["step_sent"].device
        state["step_offered"] = to_device(state["step_offered"], device) + offered
    else:
        state["step_sent"] = state["step_sent"] + int(sent)
        state["step_offered"] = state["step_offered"] + offered
