"""``--auto-outer``: per-step communication first, outer-step training once it pays.

:class:`SwitchingStepper` runs a run's steps through the per-step stepper
(:class:`~gradzip.train.steppers.SimStepper` or :class:`~gradzip.train.steppers.DDPStepper`,
with ``--compressor auto``) and, after every step, weighs each new decision of
:class:`~gradzip.Auto` with :func:`~gradzip.plan.outer_switch`. The first decision that says
switch (past the critical phase, or at the first decision with ``--auto-outer-early``; an
outer-step candidate predicted faster by Auto's margin) is
carried out at the start of the next step, so the loop's optimizer step of the deciding step
has run. With ``auto(warmup=0)`` and ``--auto-outer-early`` the stepper takes the first
decision itself before step 0 (:meth:`~gradzip.Auto.first_decision`), priced with compute it
times (:meth:`SwitchingStepper.time_compute`) and, where a bound that prices compression
free does not settle it, each level's measured compression time
(:meth:`SwitchingStepper.level_overheads`), and any predicted gain switches (no margin: see
:meth:`SwitchingStepper._decide_before_start`); a switch there is carried out before step 0.
The switch:

1. the replicas' parameters are checked equal by a 24-byte digest per worker, all-gathered
   (:func:`~gradzip.outer.consensus.agree_on_parameters`; counted in the run's bytes), and
   averaged with one dense fp32 all-reduce only where they differ: per-step training keeps
   them equal, and the outer loop's anchor must be the same on every worker;
2. the per-step engine's error-feedback residuals are dropped (their norm is recorded): they
   are compression error of past *gradients*, while the outer loop compresses parameter
   deltas, another space and scale; sending them once densely would cost a full exchange to
   correct one step's compression error;
3. an :class:`~gradzip.train.outer_stepper.OuterStepper` takes over, its anchor the agreed
   parameters, ``H``, outer learning rate, momentum and exchange the candidate's (dense,
   ``none``, or compressed with error feedback, such as 8-bit ``scatterq:bits=8``), and each
   worker's inner optimizer continuing from the loop optimizer's state.

The candidates are every ``H`` of ``--auto-outer-steps`` with every exchange of
``--auto-outer-exchanges`` (dense and 8-bit by default). A compressed exchange is priced with
its compression time, measured once on this model's shapes before the first decision that
weighs it (:meth:`SwitchingStepper.candidate_overheads`; the maxima over the ranks, kept in
checkpoints).

Counters are cumulative across the switch (the per-step ones, the exchange, the outer ones),
and a checkpoint holds the per-step state, the switch and the outer loop's state, so a run
resumed on either side of the switch continues exactly. Training does not switch back.

With ``--auto-outer-follow`` (:meth:`SwitchingStepper._follow`) the candidates are weighed
again at each synchronisation, from the compute and exchange times measured there, and the
outer loop is rebuilt for another candidate where two synchronisations in a row choose it.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any

import torch
from torch import Tensor, nn

from gradzip.comm import Collective, ProcessGroupCollective, SimulatedGroup
from gradzip.compressors.base import Compressor
from gradzip.ops.flat import flatten_workers, unpack
from gradzip.outer.consensus import agree_on_parameters
from gradzip.plan import (
    Auto,
    Candidate,
    Traffic,
    outer_switch,
    outer_switch_bound,
)
from gradzip.plan.measure import max_over_ranks, median
from gradzip.plan.timing import TimingCache, measure_compress_seconds, timing_key
from gradzip.plan.traffic_cache import TrafficCache, stored_or_simulated
from gradzip.spec import compressor_from_spec
from gradzip.train.metrics import format_bytes
from gradzip.train.outer_stepper import OuterStepper
from gradzip.train.steppers import DDPStepper, SimStepper, to_device

__all__ = ["SwitchingStepper", "exchange_suffix", "outer_candidates", "switch_line"]

log = logging.getLogger(__name__)

#: The counters the loop reads, summed across the switch.
_COUNTERS = ("payload_bytes", "wire_bytes", "dense_payload_bytes", "dense_wire_bytes")


#: Synchronisations in a row that must choose the same other candidate before it is taken.
_AGREEING = 2
#: The bandwidth a synchronisation whose exchange took no measurable time is priced at.
_MAX_MBIT = 1e6
#: A candidate's outer-loop settings, as a switch record names them.
_SETTINGS = ("candidate", "outer_steps", "outer_lr", "outer_momentum", "exchange")


def _settings(verdict: dict[str, Any]) -> dict[str, Any]:
    """The candidate's settings of a switch record (the dense exchange where an older record
    names none)."""
    return {k: verdict.get(k, "none") for k in _SETTINGS}


def _zero_counters(workers: int) -> dict[str, Any]:
    return {**{k: [0] * workers for k in _COUNTERS}, "steps": 0, "skipped_steps": 0}


def _add_counters(total: dict[str, Any], stats: dict[str, Any]) -> None:
    """Add an outer loop's counters to ``total`` (in place)."""
    for k in _COUNTERS:
        total[k] = [a + b for a, b in zip(total[k], stats[k], strict=True)]
    total["steps"] += int(stats["steps"])
    total["skipped_steps"] += int(stats["skipped_steps"])


def _traffic_store() -> TrafficCache | None:
    """The simulated-exchange cache on disk, or ``None`` (with a warning) where it cannot be
    read: the exchanges are then simulated, as without it."""
    try:
        return TrafficCache()
    except (OSError, ValueError) as exc:
        log.warning("simulated traffic not cached (%s): simulating", exc)
        return None


def outer_candidates(steps: tuple[int, ...],
                     exchanges: tuple[str, ...] = ("none",)) -> tuple[Candidate, ...]:
    """The outer-step candidates of ``--auto-outer``: DiLoCo at each ``H`` with each exchange
    (``diloco-h30`` dense, ``diloco-h30-8bit`` for ``scatterq:bits=8``, else the spec in the
    name), the outer learning rate and momentum from ``H`` by the default rule."""
    return tuple(Candidate(f"diloco-h{h}{exchange_suffix(spec)}", spec, "outer", h)
                 for h in steps for spec in exchanges)


def exchange_suffix(spec: str) -> str:
    """The part of a candidate's name that says its exchange: ``""`` for the dense one,
    ``"-8bit"`` for ``scatterq:bits=8``, else ``"-"`` and the spec (in its stable form)."""
    stable = compressor_from_spec(spec).spec()
    return {"none": "", "scatterq": "-8bit"}.get(stable, f"-{stable}")


class SwitchingStepper:
    """The stepper of a run with ``auto_outer`` (the interface of
    :class:`~gradzip.train.steppers.SimStepper`): per-step communication until Auto's decision
    says outer steps pay, outer-step training from then on.

    Args:
        model, task, compressor, cfg, optimizer, device: as for the other steppers;
            ``compressor`` must be an :class:`~gradzip.Auto`.

    Raises:
        TypeError: ``compressor`` is not an Auto.
    """

    def __init__(self, model: nn.Module, task: Any, compressor: Compressor, cfg: Any,
                 optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        if not isinstance(compressor, Auto):
            raise TypeError(f"`compressor` must be an Auto with auto_outer, got "
                            f"{type(compressor).__name__}")
        self.model, self.task, self.cfg, self.device = model, task, cfg, device
        self.auto, self.loop_optimizer = compressor, optimizer
        kind: Any = SimStepper if cfg.launcher == "sim" else DDPStepper
        self.per_step: SimStepper | DDPStepper = kind(model, task, compressor, cfg, optimizer,
                                                      device)
        self.world = self.per_step.world
        self.local_ranks = self.per_step.local_ranks
        self.candidates = outer_candidates(tuple(cfg.auto_outer_steps),
                                           tuple(cfg.auto_outer_exchanges))
        self.shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
        self.outer: OuterStepper | None = None
        self._saved_outer: dict[str, Any] | None = None  # loaded, built at first use
        self._fresh: list[dict[str, Any]] = []  # evaluations the loop has not taken yet
        self._traffic: dict[str, Traffic] | None = None  # by spec, simulated once
        # Plain data, all of it in checkpoints.
        self.steps = 0  # optimizer steps taken through this stepper
        self.seen = 0  # Auto decisions evaluated
        self.evaluations = 0
        self.last: dict[str, Any] | None = None  # the latest evaluation
        self.pending: dict[str, Any] | None = None  # decided, to be carried out next step
        self.switch: dict[str, Any] | None = None  # carried out
        # Compression seconds of one exchange by candidate spec (maxima over the ranks),
        # measured before the first decision that weighs a compressed exchange.
        self.exchange_costs: dict[str, float] | None = None
        self.exchange = {"payload": [0] * len(self.local_ranks),
                         "wire": [0] * len(self.local_ranks)}
        # --auto-outer-follow: the candidate in force (the switch's, then each change's) with
        # the step it started at; the step times of the interval in progress; the candidate
        # the last synchronisation chose over it, and how many in a row did; the counters of
        # the outer loops replaced, which the run's totals keep.
        self.active: dict[str, Any] | None = None
        self.interval: list[float] = []
        self.streak: tuple[str, int] | None = None
        self.changes = 0
        self.retired = _zero_counters(len(self.local_ranks))

    # -- the step ---------------------------------------------------------------------------
    def step(self, batches: list[list[Any]], carries: list[Any]) -> float:
        """One step: per-step (then the new Auto decisions weighed), or outer-step training
        (carrying a pending switch out first)."""
        comm = None
        if self.steps == 0 and self.switch is None and self._decides_before_start():
            comm = self._collective()
            start = self.auto.clock()
            self._decide_before_start(batches[0], carries[0], comm)
            assert self.last is not None
            # What the decision cost this worker before step 0 (timing compute, probing,
            # benchmarking, simulating traffic): its own clock, recorded, never compared.
            self.last["decision_seconds"] = self.auto.clock() - start
        if self.pending is not None:
            self._carry_out(comm)
        elif comm is not None:  # the probes of a first decision that kept per-step training
            self._count_exchange(comm)
            if 0 in self.local_ranks:
                log.info("%s", switch_line({"switched": False, "last": self.last}))
        outer = self._outer()
        if outer is not None:
            start = self.auto.clock()
            loss = outer.step(batches, carries)
            if self.cfg.auto_outer_follow:
                self._follow(outer, self.auto.clock() - start)
        else:
            loss = self.per_step.step(batches, carries)
            self._weigh_new_decisions()
        self.steps += 1
        return loss

    def _decide_before_start(self, micro: list[Any], carry: Any, comm: Collective) -> None:
        """The first decision, before step 0, with compression measured only where it could
        change the verdict.

        Compute is timed (:meth:`time_compute`) and the link probed first, and the verdict
        is weighed against the cheapest level the decision may choose, its compression
        priced free. Compression adds to per-step prices only (the outer candidates' own
        compression, measured first, is priced alike in both), so where outer steps win
        against that lower bound they win against every measured price, at the same
        candidate (its choice reads compute, link and the candidates' compression alone):
        the switch is taken on the bound (its record's ``priced`` is ``"bound"``, its
        ``gain`` a lower bound) and the levels' compression benchmark, a third of what every
        worker spent before step 0 on the race's model, is skipped.
        Otherwise each allowed level's compression is measured and the decision is taken
        again on the link already probed (``priced``: ``"measured"``).

        Unlike every later decision, this one switches on any predicted gain (margin 0).
        Auto's margin is hysteresis: a later switch must pay for itself (the parameters
        checked and exchanged, the residuals dropped) and must not follow noise between
        near-equal prices. Before step 0 there is nothing to pay and no earlier choice to
        hold. And this decision prices per-step training low: its compute is one forward and
        backward pass, while a synchronised step also waits for the slowest worker, and its
        compression is CPU time on one thread. Where it stayed on a gain short of the
        margin, the next decision, priced from timed steps, switched 11 or 21 steps later
        with a predicted gain of 5-18%, in each of the 8 such runs of BENCHMARKS section 7's
        2- and 4-worker races.

        Every branch reads the records' maxima over the ranks, so all ranks take the same."""
        # Every level's and candidate's exchange, read from the cache on disk where a run on
        # this machine simulated it before (the decision below then finds them on Auto).
        self._known_traffic()
        compute = self.time_compute(micro, carry)
        # The compression costs' maxima over the ranks (where they are exchanged now) are the
        # last collective before the link probe, with no work in between: the ranks leave it
        # together, so the probe needs no lining-up call of its own. Every call before step
        # 0 costs at least the link's latency on each of its hops (101 ms for one float with
        # 2 workers over a 100 ms round trip; a ring of W workers makes 2 (W - 1) hops).
        lined_up = self._overheads_exchanged_now()
        self.candidate_overheads(comm)
        ranks, device = self.local_ranks, self.device
        record = self.auto.first_decision(self.shapes, comm, ranks=ranks, device=device,
                                          compute_s=compute, lined_up=lined_up)
        allowed = self.auto.allowed(bool(record["critical"]))
        bound = outer_switch_bound(record, {lb: self._spec(lb) for lb in allowed},
                                   **self._switch_options(margin=0.0))
        if bound["switch"]:
            self._keep({"kind": "outer_switch", **bound, "priced": "bound"})
            return
        link = (float(record["bandwidth_mbit"]), float(record["rtt_ms"]))
        measured = self.auto.first_decision(self.shapes, comm, ranks=ranks, device=device,
                                            compute_s=compute, overhead_s=self.level_overheads(),
                                            link=link)
        self._keep(self._verdict(measured, margin=0.0))

    def time_compute(self, micro: list[Any], carry: Any, repeats: int | None = None) -> float:
        """Seconds of one worker's compute for a step: forward and backward over its
        micro-batches ``micro`` (from carried state ``carry``), the fastest of ``repeats``
        passes, read with Auto's clock.

        ``repeats`` defaults to 2 on a GPU, where the first pass also pays one-off costs
        (kernels loaded, library handles made, allocator pools grown) that can take longer
        than the pass itself, and to 1 elsewhere: on the CPU the first pass of the race's
        model took 0.221 s against 0.207-0.216 s for the next ones (within 7%), and the
        second pass was half of what the decision before step 0 cost once the compression
        times and the traffic are cached (0.38 of about 0.39 s in one simulated process).

        Nothing the run keeps changes: the gradients are taken with
        ``torch.autograd.grad`` (no ``.grad`` written, no DDP hook fired: DDP's reducer hooks
        the accumulation into ``.grad``), BatchNorm's running statistics are restored and
        the random number generators forked (dropout draws here are not the step's draws),
        so the run's step 0 trains exactly as it would without this measurement."""
        cuda = self.device.type == "cuda"
        if repeats is None:
            repeats = 2 if cuda else 1
        params = [p for p in self.model.parameters() if p.requires_grad]
        buffers = [b.detach().clone() for b in self.model.buffers()]
        best = float("inf")
        with torch.random.fork_rng(devices=[self.device] if cuda else []):
            for _ in range(repeats):
                if cuda:
                    torch.cuda.synchronize(self.device)
                start, state = self.auto.clock(), carry
                for batch in micro:  # the task returns a new carry; the run's is not touched
                    loss, state = self.task.loss(self.model, to_device(batch, self.device),
                                                 state)
                    torch.autograd.grad(loss / len(micro), params, allow_unused=True)
                if cuda:
                    torch.cuda.synchronize(self.device)
                best = min(best, self.auto.clock() - start)
        with torch.no_grad():
            for b, saved in zip(self.model.buffers(), buffers, strict=True):
                b.copy_(saved)
        return max(best, 0.0)

    def level_overheads(self) -> dict[str, float] | None:
        """Each of Auto's levels' compression seconds per step on this model's shapes
        (:meth:`compress_seconds`: one engine step of one worker, CPU time on one thread,
        cached), for a decision before any step has run one; ``None``
        on a GPU, where that CPU micro-benchmark does not measure the device's time.

        Only the levels that decision may choose are measured (:meth:`Auto.allowed
        <gradzip.plan.auto.Auto.allowed>` of a critical phase: a first decision is always
        critical); the others' price is never compared, and they get 0. Half of the default
        levels' benchmark, paid by every worker before step 0, is saved."""
        if self.device.type != "cpu":
            return None
        allowed = self.auto.allowed(critical=True)
        return {label: (self.compress_seconds(level.spec())  # type: ignore[union-attr]
                        if label in allowed else 0.0)
                for label, level in zip(self.auto.labels, self.auto.levels, strict=True)}

    def compress_seconds(self, spec: str) -> float:
        """One engine step of ``spec`` on this model's shapes, one worker, CPU time on one
        thread (:func:`~gradzip.plan.timing.measure_compress_seconds`), read from the
        compression-time cache that ``gradzip plan`` keeps where this machine measured it
        before (:class:`~gradzip.plan.TimingCache`: ``$GRADZIP_PLAN_TIMINGS``, else
        ``~/.cache/gradzip/plan-timings.json``; keyed by spec, shapes, device and torch
        version), else measured and written there. The benchmark costs a worker a large part
        of what it spends before step 0 (0.43 s of 1.35 s for the 8-bit exchange on the
        race's model), so a later run on the same machine skips it. A cache that cannot be
        read or written is passed over with a warning: the time is measured anyway."""
        key = timing_key(spec, self.shapes)
        try:
            cache = TimingCache()
            found = cache.get(key)
        except (OSError, ValueError) as exc:
            log.warning("compression times not cached (%s): measuring", exc)
            return measure_compress_seconds(spec, self.shapes)
        if found is not None:
            return found
        seconds = measure_compress_seconds(spec, self.shapes)
        try:
            cache.put(key, seconds)
        except OSError as exc:
            log.warning("compression time not cached (%s)", exc)
        return seconds

    def _weigh_new_decisions(self) -> None:
        """Weigh each Auto decision made during the last step against outer-step training."""
        state = self.per_step.compressor_state
        if state is None:
            return
        count = Auto.counts(state)["decisions"]
        if count == self.seen:
            return
        for record in Auto.decisions(state, since=self.seen):
            if int(record["step"]) == 0 and self._decides_before_start():
                # Weighed already, before step 0, with compute timed and compression
                # measured; Auto's own decision in step 0 timed no step and prices compute at
                # a floor, which favours outer steps on any link: it must not overrule that.
                continue
            self._weigh(record)
        self.seen = count

    def _decides_before_start(self) -> bool:
        """Whether the first decision falls before step 0 and may switch (``warmup=0`` with
        ``--auto-outer-early``): it is then taken here, before the step, so that a switch
        makes step 0 the outer loop's first local step, as in DiLoCo from the start, rather
        than one synchronised step at Auto's level whose compression error the switch would
        drop (a PowerSGD step under AdamW, whose first update is about lr times each entry's
        sign, cost the run more than the rest recovered)."""
        return bool(self.cfg.auto_outer_early) and self.auto.warmup == 0

    def _weigh(self, record: dict[str, Any]) -> None:
        """Weigh one Auto decision record against outer-step training; a switch is pending
        from the first that says so."""
        if self.exchange_costs is None:
            # Every rank weighs the same records at the same step (they are built from
            # maxima over the ranks), so every rank measures here, together.
            comm = self._collective()
            self.candidate_overheads(comm)
            self._count_exchange(comm)
        self._keep(self._verdict(record))

    def candidate_overheads(self, comm: Collective) -> dict[str, float]:
        """Compression seconds of one exchange for each compressed exchange among the
        candidates (:meth:`compress_seconds`: cached, or measured on this model's shapes),
        the maxima over the ranks (one all-reduce of a float
        per spec), so that every rank prices the candidates alike; measured once, then kept
        (and checkpointed). The dense exchange is priced without compression, as before any
        candidate was compressed; so is every exchange on a GPU, where that CPU
        micro-benchmark does not measure the device's time (no collective is issued then,
        nor where no candidate compresses)."""
        if self.exchange_costs is None:
            costs: dict[str, float] = {}
            if self._overheads_exchanged_now():
                specs = self._compressed_specs()
                mine = [self.compress_seconds(spec) for spec in specs]
                most = max_over_ranks(comm, mine, self.device)
                costs = dict(zip(specs, most, strict=True))
            self.exchange_costs = costs
        return self.exchange_costs

    def _compressed_specs(self) -> list[str]:
        return sorted({c.spec for c in self.candidates if c.spec != "none"})

    def _overheads_exchanged_now(self) -> bool:
        """Whether :meth:`candidate_overheads` issues its all-reduce when called now (its
        one test of that, so a caller that relies on the call sees the same answer; the same
        on every rank: configuration and restored state only)."""
        return (self.exchange_costs is None and bool(self._compressed_specs())
                and self.device.type == "cpu")

    def _verdict(self, record: dict[str, Any], margin: float | None = None) -> dict[str, Any]:
        """The switch evaluation of one Auto decision record (nothing kept); ``margin``:
        Auto's unless given."""
        verdict = outer_switch(record, self._spec(str(record["level"])),
                               **self._switch_options(margin))
        return {"kind": "outer_switch", **verdict, "priced": "measured"}

    def _spec(self, label: str) -> str:
        return self.auto.levels[self.auto.labels.index(label)].spec()  # type: ignore[union-attr]

    def _switch_options(self, margin: float | None = None) -> dict[str, Any]:
        """What :func:`outer_switch` reads besides the record and the level; ``margin``:
        Auto's unless given (0 before step 0: :meth:`_decide_before_start`)."""
        # The record's inputs are maxima over the ranks (Auto aggregates them before it
        # decides) and everything else here is configuration or shapes, so every rank
        # reaches the same verdict and carries the switch out at the same step: the
        # collectives that follow (the parameter exchange, the outer loop's) match.
        return {"shapes": self.shapes, "workers": self.world,
                "margin": self.auto.margin if margin is None else margin,
                "candidates": self.candidates,
                "bandwidth_mbit": self.cfg.auto_outer_bandwidth_mbit,
                "traffic": self._known_traffic(), "early": self.cfg.auto_outer_early,
                "candidate_overhead_s": self.exchange_costs}

    def _keep(self, verdict: dict[str, Any]) -> None:
        """Record a switch evaluation; a switch is pending from the first that says so."""
        self.evaluations += 1
        self.last = verdict
        self._fresh.append(verdict)
        if verdict["switch"] and self.pending is None:
            self.pending = verdict

    def _known_traffic(self) -> dict[str, Traffic]:
        """Every level's and candidate's traffic by spec: Auto's own (cached on it; the
        same shapes unless rules route some tensors elsewhere), the candidates' simulated
        once here (seconds for a large model, not to be paid at every decision)."""
        if self._traffic is None:
            store = _traffic_store()
            by_label = self.auto.traffic(self.shapes, self.world, store)
            known = {level.spec(): by_label[label] for label, level in  # type: ignore[union-attr]
                     zip(self.auto.labels, self.auto.levels, strict=True)}
            for c in self.candidates:
                if c.spec not in known:
                    known[c.spec] = stored_or_simulated(c.spec, self.world, self.shapes, store)
            self._traffic = known
        return self._traffic

    def take_records(self) -> list[dict[str, Any]]:
        """The switch evaluations made since the last call (for the run's decision log)."""
        fresh, self._fresh = self._fresh, []
        return fresh

    # -- the switch -------------------------------------------------------------------------
    def _collective(self) -> Collective:
        return SimulatedGroup(self.world) if self.cfg.launcher == "sim" else ProcessGroupCollective()

    def _count_exchange(self, comm: Collective) -> None:
        """Add what ``comm`` sent (the switch's probes and parameter exchange, each rank's
        own) to the exchange counters."""
        self.exchange = {
            own: [a + b for a, b in zip(self.exchange[own], meter, strict=True)]
            for own, meter in (("payload", comm.meter.payload), ("wire", comm.meter.wire))}

    @torch.no_grad()
    def _agree_on_parameters(self, comm: Collective) -> bool:
        """Make the replicas' trained parameters the same on every worker (see
        :func:`agree_on_parameters`); whether they differed."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        flat = flatten_workers([p.detach().to(torch.float32) for p in params], 1)
        # The simulated workers share the one replica: each contributes it.
        rows = flat.expand(self.world, -1) if comm.simulated else flat
        mean = agree_on_parameters(rows, comm)
        if mean is not None:
            for p, part in zip(params, unpack(mean, [p.shape for p in params]), strict=True):
                p.copy_(part)
        return mean is not None

    def _drop_residuals(self) -> float:
        """Drop the per-step engine's error-feedback residuals; their norm over every worker."""
        engine = self.per_step.engine
        residuals = dict(engine.residuals) if engine is not None else {}
        if self.steps == 0:
            # A switch before step 0: no step has made a residual on any worker, and every
            # rank knows it from the step count alone, so no all-reduce is needed to say so
            # (on a long link it would cost every hop's latency before the first step).
            assert not residuals, "residuals before the first step"
            return 0.0
        squares = torch.zeros(self.world, dtype=torch.float64)
        for name in sorted(residuals):
            rows = residuals[name].detach().reshape(len(self.local_ranks), -1)
            for i, rank in enumerate(self.local_ranks):
                squares[rank] += float(torch.linalg.vector_norm(rows[i].double())) ** 2
        if engine is not None:
            engine.residuals = {}
        # Each worker's sum in its own slot, zeros elsewhere: the sum over ranks is exact and
        # the total below adds the workers in rank order, as the simulator does.
        squares = self.per_step.all_sum(squares)
        return float(sum(float(s) for s in squares)) ** 0.5

    def _build_outer(self, verdict: dict[str, Any]) -> OuterStepper:
        cfg = dataclasses.replace(
            self.cfg, outer_steps=int(verdict["outer_steps"]), outer_lr=verdict["outer_lr"],
            outer_momentum=verdict["outer_momentum"], outer_optimizer="nesterov", fragments=1,
            outer_delay=0, rules=(), dense_1d=False, min_numel=0, auto_outer=False)
        for p in self.model.parameters():
            p.grad = None  # the last per-step gradient is spent; replicas start without one
        # A switch recorded before candidates had exchanges of their own was dense.
        exchange = compressor_from_spec(str(verdict.get("exchange", "none")))
        return OuterStepper(self.model, self.task, exchange, cfg, self.loop_optimizer,
                            self.device)

    def _carry_out(self, comm: Collective | None = None) -> None:
        """Agree on the parameters, drop the residuals, start the outer loop (every rank at
        the same step: the decision was the same everywhere). ``comm``: the group that
        already carried this step's probes (a decision before step 0), so the exchange's
        bytes count them."""
        verdict, self.pending = self.pending, None
        assert verdict is not None
        comm = comm if comm is not None else self._collective()
        differed = self._agree_on_parameters(comm)
        self._count_exchange(comm)
        norm = self._drop_residuals()
        self.outer = self._build_outer(verdict)
        state = self.loop_optimizer.state_dict()
        for inner in self.outer.inner:  # each worker continues the per-step optimizer's state
            inner.load_state_dict(copy.deepcopy(state))
        self.active = {**_settings(verdict), "since": self.steps}
        self.switch = {**verdict, "switched_at": self.steps,
                       "exchange_payload_bytes": max(self.exchange["payload"]),
                       "exchange_wire_bytes": max(self.exchange["wire"]),
                       "replicas_differed": differed, "dropped_residual_norm": norm}
        if 0 in self.local_ranks:
            log.info("%s", switch_line({"switched": True, "switch": self.switch}))

    def _outer(self) -> OuterStepper | None:
        """The outer stepper once switched (built here after a resume: its construction is a
        collective in a process group, so it waits for the loop, where every rank is)."""
        if self.outer is None and self._saved_outer is not None:
            assert self.switch is not None
            outer = self._build_outer(self._in_force())
            outer.load_state_dict(self._saved_outer)
            self.outer, self._saved_outer = outer, None
        return self.outer

    def _in_force(self) -> dict[str, Any]:
        """The outer candidate in force: the last change's, else the switch's."""
        if self.active is not None:
            return self.active
        assert self.switch is not None
        return {**_settings(self.switch), "since": int(self.switch["switched_at"])}

    # -- following the link once outer steps run (--auto-outer-follow) ----------------------
    def _follow(self, outer: OuterStepper, took: float) -> None:
        """Time one outer step; at a synchronisation, weigh the candidates again.

        Between synchronisations a step is compute alone (the inner steps issue no
        collective); the synchronising step adds the exchange. Their difference, with the
        interval's median step as its compute, prices the link as it is now. Every rank
        weighs the maxima over the ranks (one all-reduce of two floats, counted with the
        switch's bytes), so every rank chooses alike and changes at the same step."""
        if not outer.synced:
            self.interval.append(took)
            return
        samples, self.interval = self.interval, []
        if not samples:  # H = 1: no step of compute alone to compare with
            return
        compute = median(samples)
        comm = self._collective()
        compute, exchange = max_over_ranks(comm, [compute, max(0.0, took - compute)], self.device)
        self._count_exchange(comm)
        verdict = self._weigh_again(compute, exchange)
        self._fresh.append(verdict)
        if verdict["change"]:
            self._change(outer, verdict)

    def _weigh_again(self, compute: float, exchange: float) -> dict[str, Any]:
        """The record of one synchronisation's weighing: the candidates priced at the link the
        exchange just measured and the compute the interval measured, by
        :func:`~gradzip.plan.outer_switch`'s rule (time per step times the step cost of each
        H; the candidate in force kept while within the margin of the cheapest); ``change``
        where two synchronisations in a row chose the same candidate other than the one in
        force."""
        assert self.switch is not None
        now = self._in_force()
        spec = str(now["exchange"])
        traffic = self._known_traffic()[spec]
        costs = self.exchange_costs or {}
        rtt_ms = float(self.switch["rtt_ms"])
        # The exchange's time less its compression and latency terms is its bytes' time.
        link_s = exchange - costs.get(spec, 0.0) - traffic.hops * rtt_ms / 1e3
        bandwidth = min(_MAX_MBIT, traffic.wire_bytes * 8 / 1e6 / max(link_s, 1e-9))
        level = str(self.switch["level"])
        record = {"critical": False, "level": level, "compute_ms": compute * 1e3,
                  "bandwidth_mbit": bandwidth, "rtt_ms": rtt_ms,
                  "calls": self.switch["calls"], "step": self.steps}
        priced = outer_switch(record, self._spec(level), **self._switch_options(),
                              keep=str(now["candidate"]))
        best = str(priced["candidate"])
        if best == now["candidate"]:
            self.streak = None
        else:
            count = self.streak[1] + 1 if self.streak and self.streak[0] == best else 1
            self.streak = (best, count)
        change = self.streak is not None and self.streak[1] >= _AGREEING
        ms = priced["predicted_ms"]
        return {"kind": "outer_follow", "step": self.steps, "in_force": now["candidate"],
                "chosen": best, "change": change, "compute_ms": compute * 1e3,
                "exchange_ms": exchange * 1e3, "bandwidth_mbit": bandwidth, "rtt_ms": rtt_ms,
                "predicted_ms": {c.name: ms[c.name] for c in self.candidates},
                **({"to": _settings(priced)} if change else {})}

    def _change(self, outer: OuterStepper, verdict: dict[str, Any]) -> None:
        """Replace the outer loop by the chosen candidate's, right after a synchronisation
        (the replicas are equal there). Each replica's buffers and inner optimizer continue;
        the outer momentum continues (the same Nesterov state, under the new H's settings);
        the exchange's error-feedback state continues where the exchange is the same, and is
        dropped where it changes (another compressor's state; the new one starts empty, as
        the switch starts its own)."""
        settings = verdict["to"]
        same = settings["exchange"] == str(self._in_force()["exchange"])
        new = self._build_outer(settings)
        for mine, before in zip(new.replicas[1:], outer.replicas[1:], strict=True):
            mine.load_state_dict(before.state_dict())
        for mine, before in zip(new.inner, outer.inner, strict=True):
            mine.load_state_dict(copy.deepcopy(before.state_dict()))
        new.outer.outer_state = {n: t.clone() for n, t in outer.outer.outer_state.items()}
        if same:  # its counters continue with it
            new.outer.engine.load_state_dict(outer.outer.engine.state_dict())
        else:  # the run's totals keep the replaced engine's
            _add_counters(self.retired, outer.stats)
        self.outer = new
        self.active = {**settings, "since": self.steps + 1}
        self.streak = None
        self.changes += 1
        if 0 in self.local_ranks:
            log.info("auto-outer: after step %d, %s -> %s (H=%d, exchange %s): predicted "
                     "%.1f against %.1f ms/step at %.3g Mbit/s, compute %.1f ms",
                     self.steps, verdict["in_force"], settings["candidate"],
                     settings["outer_steps"], settings["exchange"],
                     verdict["predicted_ms"][settings["candidate"]],
                     verdict["predicted_ms"][verdict["in_force"]], verdict["bandwidth_mbit"],
                     verdict["compute_ms"])

    # -- the interface the loop uses --------------------------------------------------------
    @property
    def engine(self) -> Any:
        """The per-step engine (its rules and Auto's state stay readable after the switch)."""
        return self.per_step.engine

    @property
    def compressor_state(self) -> Any:
        """Auto's state (after the switch, as it was at the switch); ``None`` after a
        switch before step 0, where no per-step step ran and Auto decided nothing."""
        if self.switch is not None and int(self.switch["switched_at"]) == 0:
            return None
        return self.per_step.compressor_state

    @property
    def averaged(self) -> dict[str, Tensor]:
        outer = self._outer()
        return outer.averaged if outer is not None else self.per_step.averaged

    @property
    def stats(self) -> dict[str, Any]:
        """Cumulative counters: per-step, plus the exchange and the outer loop's once
        switched (the exchange counts as one round)."""
        per = self.per_step.stats
        out = {k: list(per[k]) for k in _COUNTERS}
        out["steps"], out["skipped_steps"] = int(per["steps"]), int(per["skipped_steps"])
        pairs = (("payload_bytes", "payload"), ("wire_bytes", "wire"),
                 ("dense_payload_bytes", "payload"), ("dense_wire_bytes", "wire"))
        for key, own in pairs:  # zeros, or the probes of a first decision that stayed
            out[key] = [a + b for a, b in zip(out[key], self.exchange[own], strict=True)]
        outer = self._outer()
        if outer is None:
            return out
        extra = dict(outer.stats)
        _add_counters(extra, self.retired)  # the outer loops replaced by --auto-outer-follow
        for key, _ in pairs:
            out[key] = [a + b for a, b in zip(out[key], extra[key], strict=True)]
        out["steps"] += 1 + int(extra["steps"])
        out["skipped_steps"] += int(extra["skipped_steps"])
        return out

    def epoch_fields(self) -> dict[str, Any]:
        """The epoch record's ``outer_steps``: ``H`` once switched, else 0."""
        return {"outer_steps": int(self._in_force()["outer_steps"]) if self.switch else 0}

    def eval_due(self, step: int, every: int) -> bool:
        """Whether the loop evaluates after ``step`` (``every``: its ``eval_every``): every
        ``every`` steps before the switch; after it, at each synchronisation, where every
        worker holds the same parameters (a time-to-target measurement then sees the
        synchronised model without an exchange of parameters)."""
        if not self.switch:
            return step % every == 0
        now = self._in_force()
        return (step - int(now["since"])) % int(now["outer_steps"]) == 0

    def eval_fields(self) -> dict[str, Any]:
        """An evaluation record's ``outer_steps`` and, once switched, ``switched_at``: an
        evaluation after the switch is at ``switched_at + k H`` (between synchronisations,
        as at an epoch's end, the loop evaluates the workers' mean: :meth:`eval_model`). With
        ``--auto-outer-follow``, also ``outer_since``, the step the H in force started at
        (synchronised at ``outer_since + k H``)."""
        if not self.switch:
            return {"outer_steps": 0}
        now = self._in_force()
        fields = {"outer_steps": int(now["outer_steps"]),
                  "switched_at": int(self.switch["switched_at"])}
        if self.cfg.auto_outer_follow:  # the H in force started there (synchronised at +kH)
            fields["outer_since"] = int(now["since"])
        return fields

    def summary_fields(self) -> dict[str, Any]:
        """``auto_outer`` for ``summary.json``: whether and where the run switched, the
        evaluation that decided it (inputs, predictions, candidate, gain), the exchange's bytes
        and the dropped residual norm; without a switch, the latest evaluation."""
        return {"auto_outer": {"switched": self.switch is not None,
                               "evaluations": self.evaluations,
                               "changes": self.changes,
                               "in_force": self._in_force() if self.switch else None,
                               "switch": self.switch,
                               "last": self.last if self.switch is None else None}}

    def state_dict(self) -> dict[str, Any]:
        """The per-step state (Auto's included), the switch, and the outer loop's state."""
        outer = self.outer.state_dict() if self.outer is not None else self._saved_outer
        return {"per_step": self.per_step.state_dict(), "outer": outer,
                "switching": {"steps": self.steps, "seen": self.seen,
                              "evaluations": self.evaluations, "last": self.last,
                              "pending": self.pending, "switch": self.switch,
                              "exchange": copy.deepcopy(self.exchange),
                              "exchange_costs": copy.deepcopy(self.exchange_costs),
                              "follow": {"active": copy.deepcopy(self.active),
                                         "interval": list(self.interval),
                                         "streak": (list(self.streak) if self.streak
                                                    else None),
                                         "changes": self.changes,
                                         "retired": copy.deepcopy(self.retired)}}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (the outer loop is rebuilt at its first use).

        Raises:
            ValueError: a state of another kind of run, or inconsistent.
        """
        if not isinstance(state, dict) or set(state) != {"per_step", "outer", "switching"}:
            raise ValueError("the state must be an auto_outer run's (keys per_step, outer, "
                             f"switching), got {sorted(state) if isinstance(state, dict) else state!r}")
        own = state["switching"]
        if (own["switch"] is None) != (state["outer"] is None):
            raise ValueError("the state's `outer` must be present exactly when it switched")
        if len(own["exchange"]["payload"]) != len(self.local_ranks):
            raise ValueError(f"the state's exchange counters must hold {len(self.local_ranks)} "
                             f"workers, got {len(own['exchange']['payload'])}")
        self.per_step.load_state_dict(state["per_step"])
        self.steps, self.seen = int(own["steps"]), int(own["seen"])
        self.evaluations, self.last = int(own["evaluations"]), own["last"]
        self.pending, self.switch = own["pending"], own["switch"]
        self.exchange = copy.deepcopy(own["exchange"])
        costs = own.get("exchange_costs")  # absent from checkpoints before compressed exchanges
        self.exchange_costs = None if costs is None else {str(k): float(v)
                                                          for k, v in costs.items()}
        # Absent from checkpoints made before --auto-outer-follow: nothing changed since the
        # switch.
        follow = own.get("follow") or {}
        self.active = copy.deepcopy(follow.get("active"))
        self.interval = [float(t) for t in follow.get("interval", [])]
        streak = follow.get("streak")
        self.streak = (str(streak[0]), int(streak[1])) if streak else None
        self.changes = int(follow.get("changes", 0))
        self.retired = (copy.deepcopy(follow["retired"]) if "retired" in follow
                        else _zero_counters(len(self.local_ranks)))
        self.outer = None
        self._saved_outer = to_device(state["outer"], self.device) if state["outer"] else None
        self._fresh = []

    def compression_error(self) -> dict[str, float | None]:
        outer = self._outer()
        return outer.compression_error() if outer is not None else self.per_step.compression_error()

    def all_sum(self, x: Tensor) -> Tensor:
        return self.per_step.all_sum(x)

    def all_max(self, x: Tensor) -> Tensor:
        return self.per_step.all_max(x)

    def eval_model(self) -> nn.Module:
        """The model the loop evaluates: once switched, the workers' mean
        (:meth:`OuterStepper.eval_model`); before, the one replica per-step training keeps."""
        outer = self._outer()
        return outer.eval_model() if outer is not None else self.model

    def sync_buffers(self) -> None:
        outer = self._outer()
        (outer if outer is not None else self.per_step).sync_buffers()


def switch_line(entry: dict[str, Any]) -> str:
    """One line saying whether a run switched to outer steps and why (``entry``: the
    summary's ``auto_outer``)."""
    rec = entry.get("switch") if entry.get("switched") else entry.get("last")
    if rec is None:
        return "auto-outer: no decision weighed outer steps (stayed per-step)"
    ms = rec["predicted_ms"]
    # Decided on a bound (a decision before step 0 that needed no more): compression priced
    # free, so the gain is at least this.
    gain = "gain at least" if rec.get("priced") == "bound" else "gain"
    # A decision before any timed step prices compute at a floor (see Auto): say so.
    compute = ("compute not timed yet" if rec["compute_ms"] < 1e-3
               else f"compute {rec['compute_ms']:.1f} ms")
    prices = (f"predicted {ms[rec['candidate']]:.1f} ms/step against {ms[rec['level']]:.1f} "
              f"for per-step {rec['level']} ({gain} {100 * rec['gain']:.0f}%; {compute}, "
              f"link {rec['bandwidth_mbit']:.3g} Mbit/s, rtt {rec['rtt_ms']:.2f} ms)")
    if entry.get("switched"):
        phase = ("it is the first decision (--auto-outer-early)" if rec.get("critical")
                 else "the phase is steady")
        agreed = ("replicas differed, parameters averaged" if rec.get("replicas_differed")
                  else "replicas checked equal")
        sent = format_bytes(rec["exchange_wire_bytes"])
        spec = rec.get("exchange", "none")  # absent from switches recorded before it was chosen
        exchange_note = "" if spec == "none" else f", exchange {spec}"
        if rec["switched_at"] == 0:  # nothing trained yet: no residual; the probes ride here
            where, exchange = "before the first step", f"{sent} per worker with the link probes)"
        else:
            where = f"after step {rec['switched_at']}"
            exchange = (f"{sent} per worker), error-feedback residual of norm "
                        f"{rec['dropped_residual_norm']:.3g} dropped")
        return (f"auto-outer: switched to outer steps {where} "
                f"({rec['candidate']}: H={rec['outer_steps']}, outer lr {rec['outer_lr']:g}, "
                f"momentum {rec['outer_momentum']:g}{exchange_note}) because {phase} and it is "
                f"{prices}; {agreed} ({exchange}")
    why = "the phase is critical" if rec["reason"] == "critical" else "it gains too little"
    return (f"auto-outer: stayed per-step (last decision at step {rec['step']}: {why}; "
            f"{rec['candidate']} {prices})")
