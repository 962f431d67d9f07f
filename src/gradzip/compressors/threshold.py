"""Hard-threshold sparsification: send every entry whose magnitude reaches lambda."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gradzip._validate import check_bool, check_choice, check_int, check_real
from gradzip.comm.base import Collective
from gradzip.compressors.base import Compressor, Job, StepContext, dense_reduce, sparse_pays
from gradzip.compressors.sharded_sparse import (
    EXCHANGES,
    choose_exchange,
    outside_own_part,
    sharded_reduce,
)
from gradzip.compressors.sparse import gather_sparse, index_bytes
from gradzip.ops.branches import cpu_form
from gradzip.ops.flat import to_device
from gradzip.ops.select import threshold_split, topk_abs

__all__ = ["HardThreshold"]

# Budget mode's control law. With error feedback an entry is sent once its accumulated
# residual crosses lambda, so one step's density reacts to lambda steeply and with a lag of
# about 1 / density steps: a controller driven by the raw step density toggles between
# "nothing sent" and "a flood" (a limit cycle between the clamps). The law therefore follows
# a moving average of step densities (newest weight _SMOOTHING), corrects by small powers
# and by at most _MAX_STEP_FACTOR per step, and keeps a run-density term that pays back an
# early overshoot. Tuned on synthetic gradients (decaying, growing, jumping and heavy-tailed
# scales; budgets 1e-3 to 0.2): the run's density lands within a few percent of the budget.
_MAX_STEP_FACTOR = 1.25
_GAIN_RECENT = 0.3
_GAIN_RUN = 0.3
_SMOOTHING = 0.05


@dataclass(frozen=True)
class HardThreshold(Compressor):
    """Send every entry with ``|g + residual| >= lam``; error feedback keeps the rest.

    One constant threshold over the whole model: no sort (O(n)), and the density varies by step
    and by worker (high early in training, tiny late). Workers first exchange how many entries
    each tensor sends (4 bytes per tensor), then all-gather values and int32 indices padded to
    the densest worker; a tensor whose densest worker would cost more than a dense all-reduce
    goes dense.

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
    host, as the all-gather form reads its sizes). The all-gather form's bytes, which vary
    by step, are estimated at ``budget * numel`` entries per worker for the choice. The
    absolute ``lam`` mode has no budget to size the parts and always all-gathers.

    Args:
        lam: the absolute threshold (> 0), or ``None`` with ``budget``.
        budget: the target run density in (0, 1], or ``None`` with ``lam``.
        padded: count the padded volume against the budget (budget mode only).
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
        if self.padded and self.budget is None:
            raise ValueError(f"`padded` needs `budget` (it shapes the budget), got lam={self.lam!r}")
        object.__setattr__(self, "exchange", check_choice("exchange", self.exchange, EXCHANGES))
        object.__setattr__(self, "owner_keep", check_int("owner_keep", self.owner_keep, minimum=1))
        if self.exchange == "sharded" and (self.budget is None or self.padded):
            raise ValueError(
                "`exchange` 'sharded' needs `budget` without `padded` (the budget sizes the "
                f"parts), got lam={self.lam!r}, padded={self.padded!r}"
            )

    def exchange_for(self, numel: int, world: int) -> str:
        """How a tensor of ``numel`` entries travels among ``world`` workers: ``"dense"``,
        ``"allgather"`` or ``"sharded"`` (shapes and configuration only: every worker agrees;
        ``"allgather"`` here may still send a tensor dense when its densest worker's count
        makes that cheaper)."""
        kept = self._kept(numel)
        return choose_exchange(self.exchange, numel, world, kept,
                               kept * (4 + index_bytes(numel)), self.owner_keep,
                               sharded_ok=self.budget is not None and not self.padded)

    def _kept(self, numel: int) -> int:
        """Entries per worker the budget allows in a tensor of ``numel`` (1 with ``lam``)."""
        return max(1, min(numel, int((self.budget or 0.0) * numel)))

    def init_state(self, shapes: Mapping[str, torch.Size]) -> dict[str, Any]:
        # lam < 0 marks "not calibrated yet" in budget mode; recent < 0 "no step seen yet".
        return {
            "lam": float(self.lam) if self.lam is not None else -1.0,
            "recent": -1.0,
            "sent": 0,
            "offered": 0,
            "step_sent": 0,
            "step_offered": 0,
        }

    def _calibrate(self, jobs: Sequence[Job], comm: Collective) -> float:
        assert self.budget is not None
        flat = torch.cat([j.tensor.reshape(comm.local_workers, -1) for j in jobs], dim=1)
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
        sharded = [j for j in jobs if self.exchange_for(j.numel, comm.world_size) == "sharded"]
        if sharded:
            self._reduce_sharded(sharded, lam, state, comm)
        if len(sharded) < len(jobs):
            chosen = {id(j) for j in sharded}
            self._reduce_gathered([j for j in jobs if id(j) not in chosen], lam, state, comm)

    def _reduce_sharded(self, jobs: Sequence[Job], lam: float, state: dict[str, Any],
                        comm: Collective) -> None:
        workers = comm.local_workers
        # NaN never reaches lambda. A worker's own part travels whole to itself (it holds the
        # owner's residual there): it offers entries of the other parts only.
        masks = [outside_own_part(j.tensor.reshape(workers, -1), comm).abs() >= lam for j in jobs]
        # What the budget counts: every worker's entries at or above lambda, summed over the
        # group (identical on every worker, so lambda stays the same everywhere), out of the
        # entries outside each worker's own part ((W - 1) n in all: the parts tile a tensor).
        offered = comm.all_reduce(torch.stack([m.sum(dim=1) for m in masks], dim=1))
        state["step_sent"] += int(offered.sum())  # the host read of this form, once per call
        state["step_offered"] += (comm.world_size - 1) * sum(j.numel for j in jobs)
        sharded_reduce(jobs, masks, [self._kept(j.numel) for j in jobs], comm, self.owner_keep)

    def _reduce_gathered(self, jobs: Sequence[Job], lam: float, state: dict[str, Any],
                         comm: Collective) -> None:
        if _selects_per_call(jobs[0].tensor.device):
            selected, all_counts = _select_call(jobs, lam, comm)
        else:
            # One pass per tensor finds the entries and writes what stays behind (the residual).
            selected = [threshold_split(j.tensor.reshape(comm.local_workers, -1), lam) for j in jobs]
            counts = torch.tensor(
                [[sel[0][w].numel() for sel in selected] for w in range(comm.local_workers)],
                dtype=torch.int32,
            )
            # Sizes first: every worker learns every worker's count, so the padding and the
            # sparse-or-dense choice below are identical everywhere.
            all_counts = comm.all_gather(counts).tolist()  # [W][T]
        widest = [max(column) for column in zip(*all_counts, strict=True)]
        # What counts against the budget: the entries workers said, or (padded) the entries
        # the wire carries, the densest worker's count from every worker.
        sent = sum(widest) * comm.world_size if self.padded else sum(map(sum, all_counts))
        state["step_sent"] += sent
        state["step_offered"] += comm.world_size * sum(j.numel for j in jobs)
        sparse_ids = [
            t for t, job in enumerate(jobs)
            if sparse_pays(job.numel, widest[t], 4 + index_bytes(job.numel), comm)
        ]
        chosen = set(sparse_ids)
        dense_reduce([j for t, j in enumerate(jobs) if t not in chosen], comm)
        for t in sparse_ids:
            jobs[t].keep(selected[t][2].reshape(jobs[t].tensor.shape))
        gather_sparse(
            [jobs[t] for t in sparse_ids],
            [selected[t][0] for t in sparse_ids],
            [selected[t][1] for t in sparse_ids],
            [widest[t] for t in sparse_ids],
            comm,
        )

    def report(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Entries sent and offered by all workers since the start (completed steps)."""
        if "sent" not in state:
            return {}
        return {"density_parts": (int(state["sent"]), int(state["offered"]))}

    def check_state(self, state: Mapping[str, Any], *, fresh: Mapping[str, Any],
                    shapes: Mapping[str, torch.Size], workers: int) -> str | None:
        """``lam`` this configuration's (``lam`` given) or > 0 (``-1.0`` before a budget's
        first step); ``recent`` a density or ``-1.0``; counters >= 0, ``sent <= offered``,
        none pending between steps (see ``Compressor.check_state``)."""
        lam, recent = state["lam"], state["recent"]
        if self.lam is not None and lam != float(self.lam):
            return f"lam: must be {float(self.lam)!r} (this compressor's `lam`), got {lam!r}"
        if self.budget is not None and not (lam > 0 or lam == -1.0):
            return f"lam: must be > 0 (or -1.0 before the first step), got {lam!r}"
        if not (recent == -1.0 or 0 <= recent <= 1):
            return f"recent: must be in [0, 1] (or -1.0 before the first step), got {recent!r}"
        for key in ("sent", "offered", "step_sent", "step_offered"):
            if state[key] < 0 or (key.startswith("step_") and state[key] != 0):
                want = "0 between steps" if key.startswith("step_") else "an integer >= 0"
                return f"{key}: must be {want}, got {state[key]!r}"
        if state["sent"] > state["offered"]:
            return f"sent: must be <= offered ({state['offered']}), got {state['sent']!r}"
        return None

    def end_step(self, state: dict[str, Any], ctx: StepContext) -> None:
        state["sent"] += state["step_sent"]
        state["offered"] += state["step_offered"]
        if self.budget is not None and state["step_offered"] > 0:
            step_density = state["step_sent"] / state["step_offered"]
            recent = state["recent"]
            recent = step_density if recent < 0 else recent + _SMOOTHING * (step_density - recent)
            state["recent"] = float(recent)
            run_density = state["sent"] / state["offered"]
            factor = (max(recent, 1e-12) / self.budget) ** _GAIN_RECENT * (
                max(run_density, 1e-12) / self.budget
            ) ** _GAIN_RUN
            factor = min(max(factor, 1 / _MAX_STEP_FACTOR), _MAX_STEP_FACTOR)
            state["lam"] = float(state["lam"] * factor)
            if not math.isfinite(state["lam"]) or state["lam"] <= 0:
                state["lam"] = float(torch.finfo(torch.float32).tiny)
        state["step_sent"] = 0
        state["step_offered"] = 0


def _selects_per_call(device: torch.device) -> bool:
    """Whether the call's entries are selected with :func:`_select_call` (off the CPU, where a
    per-tensor search would make the host wait for every tensor; the CPU's one-pass scan is
    faster there)."""
    return not cpu_form(device)


Selection = tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]


def _select_call(
    jobs: Sequence[Job], lam: float, comm: Collective
) -> tuple[list[Selection], list[list[int]]]:
    """What :func:`~gradzip.ops.select.threshold_split` gives for every job, and every
    worker's counts, with one host read per call and a few ops whatever the number of tensors.

    The call's tensors are laid end to end; the counts per tensor come from a prefix sum of the
    mask and are all-gathered on the device, then read once (the documented wait: the
    message's size depends on them); knowing its own counts, the host has the selected
    positions listed without a wait (``nonzero_static``), in the same ascending order.

    Returns:
        ``(selected, all_counts)``: per job ``(values, indices, rest)`` as ``threshold_split``
        returns them, and ``[W][T]`` counts in rank order.
    """
    workers = comm.local_workers
    device = jobs[0].tensor.device
    numels = [job.numel for job in jobs]
    flat = torch.cat([job.tensor.reshape(workers, -1) for job in jobs], dim=1)  # [L, total]
    total = flat.shape[1]
    mask = flat.abs() >= lam  # NaN never reaches lambda, as in threshold_split
    bounds = [0]
    for n in numels:
        bounds.append(bounds[-1] + n)
    prefix = torch.nn.functional.pad(mask.cumsum(dim=1), (1, 0))  # [L, total + 1]
    at = to_device(torch.tensor(bounds, dtype=torch.int64), device)
    ends = prefix.index_select(1, at)
    counts = (ends[:, 1:] - ends[:, :-1]).to(torch.int32)  # [L, T]
    all_counts = comm.all_gather(counts).tolist()  # the call's one host read
    # This process's workers, in order (their rows of the gathered counts).
    own = [all_counts[comm.first_rank + w] for w in range(workers)]
    found = torch.nonzero_static(mask, size=sum(map(sum, own)))  # [N, 2], row-major
    cols = found[:, 1]
    picked = flat.reshape(-1).index_select(0, found[:, 0] * total + cols)
    # Each entry's position in its own tensor: its column minus its tensor's first column.
    firsts = torch.tensor([bounds[t] for row in own for t in range(len(row))], dtype=torch.int64)
    sizes = [c for row in own for c in row]
    local = cols - to_device(firsts, device).repeat_interleave(
        to_device(torch.tensor(sizes, dtype=torch.int64), device), output_size=cols.numel()
    )
    rest = flat.masked_fill(mask, 0.0)
    value_parts = torch.split(picked, sizes)
    index_parts = torch.split(local, sizes)
    count = len(jobs)
    selected: list[Selection] = []
    for t in range(count):
        values = [value_parts[w * count + t] for w in range(workers)]
        indices = [index_parts[w * count + t] for w in range(workers)]
        selected.append((values, indices, rest[:, bounds[t] : bounds[t + 1]]))
    return selected, all_counts
