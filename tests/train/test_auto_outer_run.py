"""``gradzip train --compressor auto --auto-outer``: per-step communication, then outer steps.

The switch is forced without reading a clock: Auto's only level is ``none`` and the link is
given as 1e-6 Mbit/s, so a dense exchange is predicted to take ~10^8 ms against a few ms of
compute, and outer steps at H = 2 halve the predicted step time whatever the machine measures;
``eta=100`` makes only Auto's first decision critical. Decisions come at the start of steps 2
and 5 (0-based, ``every=3, warmup=2``); the one at step 5 says switch, so the run switches
after 6 optimizer steps (the end of epoch 1: digits at 2 workers takes 6 steps an epoch).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from test_resume import TINY, records
from torch import nn

from gradzip.cli import main
from gradzip.comm import SimulatedGroup
from gradzip.comm.base import allgather_wire_bytes, allreduce_wire_bytes
from gradzip.plan import Auto
from gradzip.plan import auto as auto_module
from gradzip.plan.measure import probe_link
from gradzip.train.auto_outer import SwitchingStepper, switch_line
from gradzip.train.config import resolve_config
from gradzip.train.outer_fields import AUTO_OUTER_EXCHANGES
from gradzip.train.rundir import load_rank_file, read_manifest
from gradzip.train.runner import RunConfig, run

AUTO = "auto(levels=none,every=3,warmup=2,eta=100)"
#: The dense exchange alone: the 8-bit one sends 4x fewer bytes and would win on this link.
FORCED: dict[str, Any] = {**TINY, "compressor": AUTO, "auto_outer": True,
                          "auto_outer_steps": (2,), "auto_outer_bandwidth_mbit": 1e-6,
                          "auto_outer_exchanges": ("none",)}
#: FORCED with the default exchanges, dense and 8-bit.
EIGHT: dict[str, Any] = {**FORCED, "auto_outer_exchanges": AUTO_OUTER_EXCHANGES}
#: Fields of a switch evaluation measured by the clock (the only ones runs may differ in).
MEASURED = {"compute_ms", "rtt_ms", "predicted_ms", "gain", "decision_seconds"}


def _summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "summary.json").read_text())


def _decisions(out: Path) -> list[dict[str, Any]]:
    return json.loads((out / "accordion_decisions.json").read_text())


def _unmeasured(record: dict[str, Any] | None) -> dict[str, Any] | None:
    if record is None:
        return None
    return {k: v for k, v in record.items() if k not in MEASURED and k not in {
        "reduce_ms", "bandwidth_mbit", "wire_bytes"}}


def _final_parameters(out: Path, rank: int = 0) -> dict[str, torch.Tensor]:
    manifest = read_manifest(out)
    assert manifest is not None
    return load_rank_file(out, manifest, rank)["model"]


def _assert_same_run(procs: Path, sim: Path) -> None:
    """Every record (bytes, rounds, the H in force, losses and accuracy; all but the relative
    compression error, which a process group pools over the ranks in another order) and
    both ranks' final parameters are the simulator's."""
    assert ([{k: v for k, v in r.items() if k != "compression_error"} for r in records(procs)]
            == [{k: v for k, v in r.items() if k != "compression_error"} for r in records(sim)])
    reference = _final_parameters(sim)
    for rank in (0, 1):
        mine = _final_parameters(procs, rank)
        assert all(torch.equal(mine[k], v) for k, v in reference.items())


def test_the_run_switches_after_the_first_steady_decision_and_counts_every_byte(tmp_path: Path) -> None:
    out = tmp_path / "switch"
    summary = run(RunConfig(**FORCED, epochs=3, log_every=1, eval_every=4,  # type: ignore[arg-type]
                            out=str(out)))
    switch = summary["auto_outer"]["switch"]
    assert summary["auto_outer"]["switched"] and summary["auto_outer"]["evaluations"] == 2
    assert switch["step"] == 5 and switch["switched_at"] == 6
    assert (switch["candidate"], switch["outer_steps"], switch["reason"]) == ("diloco-h2", 2,
                                                                              "steady and faster")
    assert (switch["outer_lr"], switch["outer_momentum"]) == (0.7, 0.5)  # the H rule at H = 2
    assert switch["gain"] > 0.49 and switch["bandwidth_mbit"] == 1e-6
    # The decision log: each Auto decision followed by its weighing.
    log = _decisions(out)
    assert [(r.get("kind"), r["step"]) for r in log] == [
        (None, 2), ("outer_switch", 2), (None, 5), ("outer_switch", 5)]
    assert [r.get("switch") for r in log] == [None, False, None, True]
    assert log[1]["reason"] == "critical"
    rows = records(out)
    epochs = [r for r in rows if r["kind"] == "epoch"]
    assert [r["outer_steps"] for r in epochs] == [0, 2, 2]
    # Evaluations every 4 steps until the switch, then at each synchronisation (6 + 2k; not
    # at an epoch's end, which has its own record); each says where the run switched.
    evals = [(r["step"], r["outer_steps"], r.get("switched_at")) for r in rows
             if r["kind"] == "eval"]
    assert evals == [(4, 0, None), (8, 2, 6), (10, 2, 6), (14, 2, 6), (16, 2, 6)]
    # Bytes: the per-step run's until the switch, the all-gather of the parameters' digests
    # (the replicas are equal: no dense exchange), then one outer exchange every 2 steps (6 in
    # the 12 steps after the switch).
    per_step = tmp_path / "per-step"
    run(RunConfig(**{**TINY, "compressor": AUTO}, epochs=1, out=str(per_step)))  # type: ignore[arg-type]
    outer = tmp_path / "outer"
    run(RunConfig(**TINY, epochs=1, outer_steps=2, out=str(outer)))  # type: ignore[arg-type]
    before = records(per_step)[-1]
    sync = records(outer)[-1]
    assert sync["rounds"] == 3
    exchange = allgather_wire_bytes(24, 2)
    assert switch["exchange_wire_bytes"] == exchange and switch["exchange_payload_bytes"] == 24
    assert switch["replicas_differed"] is False
    last = epochs[-1]
    for key, ex in (("wire_bytes", exchange), ("payload_bytes", 24),
                    ("dense_wire_bytes", exchange), ("dense_payload_bytes", 24)):
        assert sync[key] % 3 == 0
        assert last[key] == before[key] + ex + 6 * (sync[key] // 3), key
    assert last["rounds"] == 6 + 1 + 6 and summary["rounds"] == 13 and summary["steps"] == 18
    # Step records: the per-step bytes until step 6, then the exchange at step 7 (with no
    # outer exchange yet), then bytes at every second step only.
    wire = {r["step"]: r["wire_bytes"] for r in rows if r["kind"] == "step"}
    assert wire[6] == before["wire_bytes"]
    assert wire[7] == wire[6] + exchange
    assert [s for s in range(8, 19) if wire[s] > wire[s - 1]] == [8, 10, 12, 14, 16, 18]


def test_early_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="`auto_outer_early` must be a bool, got 1"):
        resolve_config(RunConfig(**{**FORCED, "out": str(tmp_path / "x"),  # type: ignore[arg-type]
                                    "auto_outer_early": 1}))


def test_early_switches_at_the_first_decision(tmp_path: Path, capsys) -> None:
    """``--auto-outer-early``: the first decision (step 2, critical for being first) switches."""
    out = tmp_path / "early"
    main(["train", "--task", "digits", "--workers", "2", "--limit-train", "200", "--milestones",
          "20", "--epochs", "2", "--compressor", AUTO, "--auto-outer", "--auto-outer-early",
          "--auto-outer-steps", "2", "--auto-outer-bandwidth-mbit", "1e-6", "--out", str(out)])
    entry = _summary(out)["auto_outer"]
    switch = entry["switch"]
    assert entry["switched"] and (switch["step"], switch["switched_at"]) == (2, 3)
    assert (switch["reason"], switch["critical"]) == ("first and faster", True)
    assert [r["outer_steps"] for r in records(out) if r["kind"] == "epoch"] == [2, 2]
    assert "because it is the first decision (--auto-outer-early)" in capsys.readouterr().out


def test_a_first_decision_before_step_0_starts_outer_steps_at_step_0(tmp_path: Path,
                                                                     capsys) -> None:
    """``warmup=0`` with ``--auto-outer-early``: the decision is taken before step 0 and the
    switch carried out there, so no step is synchronised at Auto's level (a compressed one's
    error the switch would drop) and the run trains exactly as DiLoCo at the chosen H from
    the first step: the same parameters and test metrics, bit for bit (a synchronised step 0,
    even dense, would differ). It costs the
    probes and the digests, counted in its bytes and in one more round."""
    auto = tmp_path / "auto"
    main(["train", "--task", "digits", "--workers", "2", "--limit-train", "200", "--milestones",
          "20", "--epochs", "2", "--eval-every", "2", "--compressor",
          "auto(levels=none,warmup=0,every=3)", "--auto-outer", "--auto-outer-early",
          "--auto-outer-steps", "2", "--auto-outer-exchange", "none",
          "--auto-outer-bandwidth-mbit", "1e-6", "--out", str(auto)])
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("auto-outer: ")]
    assert line[0].startswith("auto-outer: switched to outer steps before the first step "
                              "(diloco-h2: H=2, outer lr 0.7, momentum 0.5) because it is the "
                              "first decision (--auto-outer-early)")
    # Compute was timed before the decision (one local forward and backward pass).
    assert re.search(r"; compute \d+\.\d ms, link 1e-06 Mbit/s", line[0])
    assert line[0].endswith("per worker with the link probes)")
    summary = _summary(auto)
    switch = summary["auto_outer"]["switch"]
    assert switch["compute_ms"] > 0
    assert switch["decision_seconds"] > 0  # what deciding cost before step 0
    assert (switch["step"], switch["switched_at"], switch["level"]) == (0, 0, "none")
    assert summary["auto_outer"]["evaluations"] == 1 and "accordion_counts" not in summary
    assert [r["kind"] for r in _decisions(auto)] == ["outer_switch"]
    diloco = tmp_path / "diloco"
    main(["train", "--task", "digits", "--workers", "2", "--limit-train", "200", "--milestones",
          "20", "--epochs", "2", "--eval-every", "2", "--outer-steps", "2", "--out", str(diloco),
          "--quiet"])
    mine, ref = _final_parameters(auto), _final_parameters(diloco)
    assert mine.keys() == ref.keys() and all(torch.equal(mine[k], ref[k]) for k in ref)
    metric = ("test_loss", "accuracy")
    ours = [(r["step"], *(r[k] for k in metric)) for r in records(auto) if r["kind"] == "eval"]
    theirs = [(r["step"], *(r[k] for k in metric)) for r in records(diloco) if r["kind"] == "eval"]
    assert ours == theirs and len(ours) == 4  # steps 2, 4, 8, 10 (epochs end at 6, 12)
    # Bytes: DiLoCo's, plus (per worker) the probes (one untimed and two timed all-reduces),
    # the maximum over ranks, and the digests' all-gather, all in the switch's exchange.
    last, ref_last = records(auto)[-1], records(diloco)[-1]
    assert switch["exchange_wire_bytes"] > allgather_wire_bytes(24, 2)
    assert last["wire_bytes"] == ref_last["wire_bytes"] + switch["exchange_wire_bytes"]
    assert last["rounds"] == ref_last["rounds"] + 1


class _Net(nn.Module):
    """BatchNorm (running statistics) and dropout (random draws): the state a timed pass
    could disturb."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5),
                                  nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class _Task:
    def loss(self, model: nn.Module, batch: Any, carry: Any) -> tuple[torch.Tensor, Any]:
        x, y = batch
        return nn.functional.cross_entropy(model(x), y), carry + 1


def test_timing_compute_before_step_0_changes_nothing_the_run_keeps(tmp_path: Path) -> None:
    """The pass that times compute for a decision before step 0 leaves the gradients, the
    running statistics and the random number generator as they were, and reports the
    fastest of its passes read from Auto's clock (here a scripted one: 0.5 s, then 0.25 s);
    on the CPU it takes one pass unless told otherwise (the next tick read is 1.5 s later)."""
    ticks = iter([0.0, 0.5, 1.0, 1.25, 2.0, 3.5])
    auto = Auto(levels="none", warmup=0, clock=lambda: next(ticks))
    cfg = resolve_config(RunConfig(**{**FORCED, "auto_outer_early": True,  # type: ignore[arg-type]
                                      "out": str(tmp_path / "x")}))
    torch.manual_seed(0)
    model = _Net()
    stepper = SwitchingStepper(model, _Task(), auto, cfg,
                               torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"))
    buffers = [b.clone() for b in model.buffers()]
    micro = [(torch.randn(5, 4), torch.tensor([0, 1, 0, 1, 1]))] * 2
    rng = torch.get_rng_state()
    assert stepper.time_compute(micro, 0, repeats=2) == 0.25
    assert stepper.time_compute(micro, 0) == 1.5
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), buffers, strict=True))
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training


def test_only_the_levels_a_first_decision_may_choose_are_benchmarked(tmp_path: Path) -> None:
    """A first decision is critical, so aggressive levels are never chosen by it: they are not
    benchmarked (0), the others are (CPU time of an engine step, > 0); where every level is
    aggressive, the first, Auto's fallback, is."""
    cfg = resolve_config(RunConfig(**{**FORCED, "auto_outer_early": True,  # type: ignore[arg-type]
                                      "out": str(tmp_path / "x")}))
    model = _Net()

    def overheads(auto: Auto) -> dict[str, float] | None:
        stepper = SwitchingStepper(model, _Task(), auto, cfg,
                                   torch.optim.SGD(model.parameters(), lr=0.1),
                                   torch.device("cpu"))
        return stepper.level_overheads()

    costs = overheads(Auto(warmup=0))
    assert costs is not None and list(costs) == Auto().labels
    assert {lb for lb, v in costs.items() if v > 0} == {"none", "fp16", "powersgd-r4"}
    assert all(costs[lb] == 0.0 for lb in ("powersgd-r2", "powersgd-r1", "topk-1%"))
    only = overheads(Auto(levels="powersgd:rank=1|topk:ratio=0.01", warmup=0))
    assert only is not None and only["powersgd-r1"] > 0 and only["topk-1%"] == 0.0


def test_compression_times_are_measured_once_per_machine(tmp_path: Path, monkeypatch) -> None:
    """The first stepper measures and writes the cache; a later one on the same machine reads
    it without measuring; a cache that cannot be read is passed over (measured anyway)."""
    from gradzip.train import auto_outer

    cache = tmp_path / "timings.json"
    monkeypatch.setenv("GRADZIP_PLAN_TIMINGS", str(cache))
    cfg = resolve_config(RunConfig(**{**EIGHT, "auto_outer_early": True,  # type: ignore[arg-type]
                                      "out": str(tmp_path / "x")}))
    model = _Net()

    def stepper() -> SwitchingStepper:
        return SwitchingStepper(model, _Task(), Auto(warmup=0), cfg,
                                torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"))

    first = stepper().compress_seconds("scatterq:bits=8")
    assert first > 0 and cache.exists()
    measured = auto_outer.measure_compress_seconds
    monkeypatch.setattr(auto_outer, "measure_compress_seconds",
                        lambda *a, **k: pytest.fail("measured again"))
    assert stepper().compress_seconds("scatterq:bits=8") == first
    cache.write_text("not a timing file")
    monkeypatch.setattr(auto_outer, "measure_compress_seconds", measured)
    assert stepper().compress_seconds("scatterq:bits=8") > 0


def test_simulated_traffic_is_read_back_by_a_later_run(tmp_path: Path, monkeypatch) -> None:
    """The first stepper simulates every level's and candidate's exchange and writes them
    beside the timing cache; a later one reads them without simulating; a cache that cannot
    be read is passed over (simulated anyway)."""
    from gradzip.plan import traffic_cache

    monkeypatch.setenv("GRADZIP_PLAN_TIMINGS", str(tmp_path / "timings.json"))
    cfg = resolve_config(RunConfig(**{**EIGHT, "auto_outer_early": True,  # type: ignore[arg-type]
                                      "out": str(tmp_path / "x")}))
    model = _Net()

    def known() -> dict[str, Any]:
        return SwitchingStepper(model, _Task(), Auto(warmup=0), cfg,
                                torch.optim.SGD(model.parameters(), lr=0.1),
                                torch.device("cpu"))._known_traffic()

    first = known()
    assert "scatterq:bits=8" in first and (tmp_path / "plan-traffic.json").exists()
    # Auto's levels and the candidates are both simulated there (stored_or_simulated).
    real = traffic_cache.measure_traffic
    monkeypatch.setattr(traffic_cache, "measure_traffic",
                        lambda *a, **k: pytest.fail("simulated"))
    assert known() == first
    (tmp_path / "plan-traffic.json").write_text("not a traffic file")
    monkeypatch.setattr(traffic_cache, "measure_traffic", real)
    assert known() == first


class _Ticks:
    """A clock that only the task moves: ``per_loss`` seconds for every loss computed."""

    def __init__(self, per_loss: float) -> None:
        self.now, self.per_loss = 0.0, per_loss

    def __call__(self) -> float:
        return self.now


class _TimedTask(_Task):
    """Each loss moves ``clock`` by its ``per_loss``; ``losses`` counts them."""

    def __init__(self, clock: _Ticks) -> None:
        self.clock, self.losses = clock, 0

    def loss(self, model: nn.Module, batch: Any, carry: Any) -> tuple[torch.Tensor, Any]:
        self.clock.now += self.clock.per_loss
        self.losses += 1
        return super().loss(model, batch, carry)


def test_a_first_decision_its_bound_settles_measures_no_compression(tmp_path: Path,
                                                                    monkeypatch) -> None:
    """Before step 0 on a slow link, outer steps win even against the cheapest allowed
    level with its compression priced free: the switch is taken on that bound, and no level's
    compression is benchmarked."""
    cfg = resolve_config(RunConfig(**{**FORCED, "auto_outer_early": True,  # type: ignore[arg-type]
                                      "out": str(tmp_path / "x")}))
    torch.manual_seed(0)
    model = _Net()
    auto = Auto(levels="none|powersgd:rank=1|topk:ratio=0.3", warmup=0, every=3)
    stepper = SwitchingStepper(model, _Task(), auto, cfg,
                               torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"))
    monkeypatch.setattr(stepper, "level_overheads", lambda: pytest.fail("benchmarked"))
    batch = (torch.randn(5, 4), torch.tensor([0, 1, 0, 1, 1]))
    stepper.step([[batch], [batch]], [0, 0])
    (verdict,) = stepper.take_records()
    assert (verdict["switch"], verdict["priced"], verdict["reason"]) == (
        True, "bound", "first and faster")
    # The cheapest level the critical first decision may choose: top-k is aggressive.
    assert verdict["level"] in ("none", "powersgd-r1")
    assert stepper.switch is not None and stepper.switch["switched_at"] == 0
    assert "(gain at least " in switch_line({"switched": True, "switch": stepper.switch})


def _one_second_link(tmp_path: Path, task: _Task, clock: _Ticks, *, levels: str = "none",
                     early: bool = True, exchanges: tuple[str, ...] = ("none",)
                     ) -> SwitchingStepper:
    """A stepper whose Auto (``levels``, read with ``clock``) decides at steps 0 and 3, over a
    link given as one second a dense exchange of :class:`_Net`'s parameters; with ``early``,
    its first decision is taken before step 0 and may switch (to outer steps with one of
    ``exchanges``)."""
    torch.manual_seed(0)
    model = _Net()
    dense = 4 * sum(p.numel() for p in model.parameters())
    cfg = resolve_config(RunConfig(**{  # type: ignore[arg-type]
        **FORCED, "auto_outer_early": early, "out": str(tmp_path / "x"),
        "auto_outer_bandwidth_mbit": dense * 8 / 1e6, "auto_outer_exchanges": exchanges}))
    auto = Auto(levels=levels, warmup=0, every=3, eta=100, clock=clock)
    return SwitchingStepper(model, task, auto, cfg,
                            torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"))


def test_a_first_decision_before_step_0_switches_on_any_gain(tmp_path: Path) -> None:
    """Compute of 50 s a step (a scripted clock) against a link priced at one second a dense
    exchange: outer steps at H = 2 gain 1%, short of Auto's margin. Before step 0 that is
    enough (nothing to pay for the switch, no earlier choice to hold against noise): the run
    is DiLoCo from step 0. Compute is timed in one pass on the CPU."""
    clock = _Ticks(50.0)
    task = _TimedTask(clock)
    stepper = _one_second_link(tmp_path, task, clock)
    batch = (torch.randn(5, 4), torch.tensor([0, 1, 0, 1, 1]))
    stepper.step([[batch], [batch]], [0, 0])
    (verdict,) = stepper.take_records()
    assert (verdict["switch"], verdict["step"], verdict["reason"], verdict["compute_ms"]) == (
        True, 0, "first and faster", 50_000.0)
    assert 0 < verdict["gain"] < stepper.auto.margin
    assert stepper.switch is not None and stepper.switch["switched_at"] == 0
    # The timed pass, then step 0's own losses (one per worker, outer steps from step 0).
    assert task.losses == 1 + 2


@pytest.mark.parametrize("exchanges", [("none",), AUTO_OUTER_EXCHANGES])
def test_a_switch_before_step_0_spares_the_calls_it_can(tmp_path: Path, monkeypatch,
                                                         exchanges: tuple[str, ...]) -> None:
    """On a long link every collective before step 0 costs at least each hop's latency.
    Where a compressed exchange is among the candidates, the all-reduce of their compression
    costs comes right before the link probe and lines the ranks up in place of the probe's
    own untimed call: the decision's group sees the same number of calls as with the dense
    exchange alone, one fewer than with the untimed call kept. And a switch before step 0
    sums no residual over the ranks (none exists yet)."""
    seen: list[bool] = []
    untimed: list[bool] = [False]  # whether the probe is made to keep its untimed call

    def probe(*a: Any, **k: Any) -> Any:
        if untimed[0]:
            k["lined_up"] = False
        seen.append(k.get("lined_up", False))
        return probe_link(*a, **k)

    monkeypatch.setattr(auto_module, "probe_link", probe)

    def calls_before_step_0(keep_untimed: bool) -> int:
        untimed[0] = keep_untimed
        clock = _Ticks(50.0)
        stepper = _one_second_link(tmp_path / str(keep_untimed), _TimedTask(clock), clock,
                                   exchanges=exchanges)
        groups: list[SimulatedGroup] = []
        monkeypatch.setattr(stepper, "_collective",
                            lambda: groups.append(SimulatedGroup(stepper.world)) or groups[-1])
        monkeypatch.setattr(stepper.per_step, "all_sum", lambda *a: pytest.fail("summed"))
        batch = (torch.randn(5, 4), torch.tensor([0, 1, 0, 1, 1]))
        stepper.step([[batch], [batch]], [0, 0])
        assert stepper.switch is not None and stepper.switch["switched_at"] == 0
        assert stepper.switch["dropped_residual_norm"] == 0.0
        return groups[0].meter.calls

    spared = calls_before_step_0(keep_untimed=False)
    compressed = exchanges != ("none",)
    assert seen == [compressed]
    if compressed:
        assert calls_before_step_0(keep_untimed=True) == spared + 1
        assert seen == [True, False]


def test_a_decision_after_step_0_needs_the_margin(tmp_path: Path) -> None:
    """The same prices at a decision after steps have run: without ``--auto-outer-early``
    the decisions at steps 0 and 3 are critical (the first two: step 0's interval had no
    gradient to compare), and the one at step 6, steady, finds outer steps faster by less
    than the margin (0.5%: compute is now the period of a step, both simulated workers'
    losses): per-step communication is kept."""
    clock = _Ticks(50.0)
    stepper = _one_second_link(tmp_path, _TimedTask(clock), clock, early=False)
    batch = (torch.randn(5, 4), torch.tensor([0, 1, 0, 1, 1]))
    for _ in range(8):
        stepper.step([[batch], [batch]], [0, 0])
    *first, later = stepper.take_records()
    assert [(r["step"], r["reason"]) for r in first] == [(0, "critical"), (3, "critical")]
    assert (later["step"], later["reason"]) == (6, "no gain")
    assert 0 < later["gain"] < stepper.auto.margin
    assert stepper.switch is None and stepper.pending is None


def test_a_timed_first_decision_that_stays_is_not_overruled_in_step_0(tmp_path: Path,
                                                                      monkeypatch) -> None:
    """Per-step Top-k 10% (a gentle level, allowed in the first decision) sends about 0.3 s
    of this link a step, outer steps at H = 2 half a dense exchange, 0.5 s: the decision
    before step 0 keeps per-step communication (its bound did not settle it: compression
    was measured, the link probed once). Auto's own decision in step 0, which timed no step,
    is not weighed; the one at step 3, with compute measured, stays too."""
    probes = []
    monkeypatch.setattr(auto_module, "probe_link",
                        lambda *a, **k: probes.append(a) or probe_link(*a, **k))
    clock = _Ticks(50.0)
    stepper = _one_second_link(tmp_path, _TimedTask(clock), clock, levels="topk:ratio=0.1")
    benchmarked, before_step = [], []
    measure, per_step = stepper.level_overheads, stepper.per_step.step
    monkeypatch.setattr(stepper, "level_overheads", lambda: benchmarked.append(1) or measure())
    monkeypatch.setattr(stepper.per_step, "step",
                        lambda *a: before_step.append(len(probes)) or per_step(*a))
    batch = (torch.randn(5, 4), torch.tensor([0, 1, 0, 1, 1]))
    stepper.step([[batch], [batch]], [0, 0])
    # One probe (then Auto's own in step 0 probes) and one compression benchmark.
    assert (before_step, len(benchmarked)) == ([1], 1)
    for _ in range(4):
        stepper.step([[batch], [batch]], [0, 0])
    first, later = stepper.take_records()  # the decision before step 0, then step 3's
    assert first["priced"] == "measured"
    assert stepper.switch is None and stepper.pending is None and stepper.evaluations == 2
    assert Auto.counts(stepper.compressor_state)["decisions"] == 2  # Auto's: steps 0 and 3
    assert (first["step"], first["reason"], first["compute_ms"]) == (0, "no gain", 50_000.0)
    assert first["gain"] < 0, first["gain"]
    assert (later["step"], later["reason"]) == (3, "no gain")


def test_a_critical_phase_keeps_per_step_communication(tmp_path: Path, capsys) -> None:
    """With ``eta`` tiny every decision is critical: weighed, never switched."""
    out = tmp_path / "critical"
    main(["train", "--task", "digits", "--workers", "2", "--limit-train", "200", "--milestones",
          "20", "--epochs", "2", "--compressor", "auto(levels=none,every=3,warmup=2,eta=1e-9)",
          "--auto-outer", "--auto-outer-steps", "2", "--auto-outer-bandwidth-mbit", "1e-6",
          "--out", str(out), "--quiet"])
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("auto-outer: stayed per-step (last decision at step 11: the "
                               "phase is critical") for line in lines) == 1
    summary = _summary(out)
    assert not summary["auto_outer"]["switched"] and summary["auto_outer"]["evaluations"] == 4
    assert summary["auto_outer"]["last"]["reason"] == "critical"
    assert summary["rounds"] == summary["steps"] == 12
    assert all(r["outer_steps"] == 0 for r in records(out) if r["kind"] == "epoch")


def test_the_cli_names_the_switch_and_why(tmp_path: Path, capsys) -> None:
    main(["train", "--task", "digits", "--workers", "2", "--limit-train", "200", "--milestones",
          "20", "--epochs", "2", "--compressor", AUTO, "--auto-outer", "--auto-outer-steps", "2",
          "--auto-outer-bandwidth-mbit", "1e-6", "--out", str(tmp_path / "cli"), "--quiet"])
    lines = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith("auto-outer: ")]
    assert len(lines) == 1
    # The default exchanges: the 8-bit one sends 4x fewer bytes over this link.
    assert lines[0].startswith("auto-outer: switched to outer steps after step 6 (diloco-h2-8bit"
                               ": H=2, outer lr 0.7, momentum 0.5, exchange scatterq:bits=8) "
                               "because the phase is steady")
    assert re.search(r"for per-step none \(gain [89]\d%", lines[0])


@pytest.mark.parametrize(("level", "stop"), [("none", 1), ("none", 2), ("topk:ratio=0.3", 1)],
                         ids=["switch-pending", "switched", "residuals-dropped-after-resume"])
def test_a_run_resumed_across_the_switch_equals_the_uninterrupted_run(tmp_path: Path,
                                                                      level: str, stop: int) -> None:
    """Stopped after epoch 1 the switch is decided but not carried out; after epoch 2 the
    outer loop runs. Either way the resumed run's records and parameters are the same bits.
    Top-k 30% keeps error-feedback residuals (restored from the checkpoint, then dropped) and
    sends 0.6x a dense all-reduce's bytes, so a dense exchange every 2 steps still gains 17%."""
    whole, part = tmp_path / "whole", tmp_path / "part"
    cfg = {**FORCED, "compressor": AUTO.replace("levels=none", f"levels={level}")}
    run(RunConfig(**cfg, epochs=3, out=str(whole)))  # type: ignore[arg-type]
    run(RunConfig(**cfg, epochs=stop, out=str(part)))  # type: ignore[arg-type]
    first = _summary(part)["auto_outer"]
    assert first["switched"] == (stop == 2)
    run(RunConfig(**cfg, epochs=3, out=str(part)), resume=True)  # type: ignore[arg-type]
    switch = _summary(whole)["auto_outer"]["switch"]
    assert switch["switched_at"] == 6
    assert (switch["dropped_residual_norm"] > 0) == (level != "none")
    assert records(part) == records(whole)
    mine, ref = _final_parameters(part), _final_parameters(whole)
    assert mine.keys() == ref.keys() and all(torch.equal(mine[k], ref[k]) for k in ref)
    a, b = _summary(part), _summary(whole)
    for key in ("final_accuracy", "bytes_sent_per_worker", "payload_bytes_per_worker",
                "dense_bytes_per_worker", "steps", "rounds", "skipped_steps", "accordion_counts"):
        assert a[key] == b[key], key
    assert _unmeasured(a["auto_outer"]["switch"]) == _unmeasured(b["auto_outer"]["switch"])
    assert ([_unmeasured(r) for r in _decisions(part)]
            == [_unmeasured(r) for r in _decisions(whole)])


@pytest.mark.parametrize(("extra", "message"), [
    ({"compressor": "powersgd:rank=2"}, "`compressor` must be auto (e.g. 'auto' or "
                                        "'auto(every=20)') with `auto_outer`, got 'powersgd:rank=2'"),
    ({"outer_steps": 4}, "`outer_steps` must be 0 with `auto_outer` (the switch chooses H), got 4"),
    ({"hsdp": 2, "launcher": "procs"}, "`hsdp` must be 0 with `auto_outer`"),
    ({"fsdp": True, "launcher": "procs"}, "`fsdp` must be False with `auto_outer`"),
    ({"accordion_batch": (32, 64)}, "`accordion_batch` must be None with `auto_outer`"),
    ({"warmup_steps": 5}, "`warmup_steps` must be 0 with `auto_outer`"),
    ({"outer_optimizer": "sgd"}, "`outer_optimizer` must be 'nesterov' with `auto_outer`"),
    ({"workers": 1}, "`workers` must be >= 2 with `auto_outer`, got 1"),
    ({"auto_outer_steps": "0,3"}, "`auto_outer_steps` must be >= 1, got 0"),
    ({"auto_outer_steps": (3, 3)}, "`auto_outer_steps` must not repeat a value, got [3, 3]"),
    ({"auto_outer": False}, "`auto_outer_steps`, `auto_outer_exchanges`, `auto_outer_early`, "
                            "`auto_outer_follow` and `auto_outer_bandwidth_mbit` need "
                            "`auto_outer`, got auto_outer=False"),
    ({"auto_outer_exchanges": ()}, "`auto_outer_exchanges` must be a non-empty list of "
                                   "compressor specs, got ()"),
    ({"auto_outer_exchanges": ("none", "scatterq", "scatterq:bits=8")},
     "`auto_outer_exchanges` must not repeat a compressor, got ['none', 'scatterq', "
     "'scatterq:bits=8']"),
    ({"auto_outer_exchanges": ("auto",)}, "`auto_outer_exchanges` must hold plain compressors, "
                                          "not controllers, got 'auto'"),
    ({"auto_outer_exchanges": ("nope",)}, "`auto_outer_exchanges` must hold compressor specs, "
                                          "got 'nope'"),
    ({"auto_outer": False, "auto_outer_early": True}, "need `auto_outer`"),
    ({"auto_outer_bandwidth_mbit": 0.0}, "`auto_outer_bandwidth_mbit` must be"),
])
def test_auto_outer_with_what_it_does_not_take_is_a_one_line_error(tmp_path: Path, extra,
                                                                   message: str) -> None:
    with pytest.raises(ValueError) as info:
        resolve_config(RunConfig(**{**FORCED, "out": str(tmp_path / "x"), **extra}))  # type: ignore[arg-type]
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_command_line_reads_the_h_list(tmp_path: Path) -> None:
    cfg = RunConfig.from_dict({**FORCED, "auto_outer_steps": "10, 30", "out": str(tmp_path / "y")})
    assert resolve_config(cfg).auto_outer_steps == (10, 30)
    assert cfg.to_dict()["auto_outer_steps"] == [10, 30]


@pytest.mark.slow
def test_procs_switch_like_the_simulator_and_resume_across_the_switch(tmp_path: Path) -> None:
    """Two gloo processes take the same decision, send what the simulator counts and, the
    arithmetic being the same, train the same bits; stopped after the switch and resumed
    (each rank rebuilding its outer loop), they end with the simulator's uninterrupted run."""
    # Top-k 30% (see above): residuals to drop, their norm pooled over the ranks.
    # The default exchanges: both ranks measure the 8-bit exchange's compression at the first
    # weighing and take the maxima, so they choose it alike (the simulator's choice).
    base: dict[str, Any] = {**EIGHT, "timeout": 300, "threads": 1,
                            "compressor": AUTO.replace("levels=none", "levels=topk:ratio=0.3")}
    procs, sim = tmp_path / "procs", tmp_path / "sim"
    run(RunConfig(**base, epochs=3, launcher="sim", out=str(sim)))  # type: ignore[arg-type]
    run(RunConfig(**base, epochs=2, launcher="procs", out=str(procs)))  # type: ignore[arg-type]
    a, b = _summary(procs)["auto_outer"], _summary(sim)["auto_outer"]
    assert a["switched"] and _unmeasured(a["switch"]) == _unmeasured(b["switch"])
    assert a["switch"]["dropped_residual_norm"] == b["switch"]["dropped_residual_norm"] > 0
    assert a["switch"]["candidate"] == "diloco-h2-8bit"
    run(RunConfig(**base, epochs=3, launcher="procs", out=str(procs)), resume=True)  # type: ignore[arg-type]
    _assert_same_run(procs, sim)


@pytest.mark.slow
def test_procs_switch_before_step_0_like_the_simulator_and_resume(tmp_path: Path) -> None:
    """A decision before step 0 in two gloo processes: the probes, the switch and the outer
    loop send what the simulator counts and train its bits; stopped after epoch 1 and resumed,
    the ranks rebuild the outer loop and end with the simulator's uninterrupted run."""
    base: dict[str, Any] = {**EIGHT, "timeout": 300, "threads": 1, "auto_outer_early": True,
                            "compressor": AUTO.replace("warmup=2", "warmup=0")}
    procs, sim = tmp_path / "procs", tmp_path / "sim"
    run(RunConfig(**base, epochs=2, launcher="sim", out=str(sim)))  # type: ignore[arg-type]
    run(RunConfig(**base, epochs=1, launcher="procs", out=str(procs)))  # type: ignore[arg-type]
    run(RunConfig(**base, epochs=2, launcher="procs", out=str(procs)), resume=True)  # type: ignore[arg-type]
    a, b = _summary(procs)["auto_outer"], _summary(sim)["auto_outer"]
    assert a["switched"] and a["switch"]["switched_at"] == 0
    assert a["switch"]["exchange"] == "scatterq:bits=8"
    assert _unmeasured(a["switch"]) == _unmeasured(b["switch"])
    _assert_same_run(procs, sim)


def test_a_compressed_exchange_is_priced_chosen_and_carried_out(tmp_path: Path) -> None:
    """With the default exchanges the 8-bit one is weighed beside the dense one at each H,
    priced with its compression time (measured once, the maxima over the workers: one
    all-reduce of a float, counted with the switch's bytes), chosen where it is faster, and
    the outer loop then sends what a static outer run with that exchange sends."""
    out = tmp_path / "eight"
    summary = run(RunConfig(**EIGHT, epochs=3, log_every=1, out=str(out)))  # type: ignore[arg-type]
    switch = summary["auto_outer"]["switch"]
    assert (switch["candidate"], switch["exchange"], switch["switched_at"]) == (
        "diloco-h2-8bit", "scatterq:bits=8", 6)
    pred = switch["predicted_ms"]
    assert set(pred) == {"none", "diloco-h2", "diloco-h2-8bit"}
    assert pred["diloco-h2-8bit"] < pred["diloco-h2"] / 2  # its bytes: 8-bit codes, scales
    # The switch's bytes: the maxima of one float per worker, then the parameters' digests.
    exchange = allreduce_wire_bytes(2 * 8, 2) + allgather_wire_bytes(24, 2)
    assert switch["exchange_wire_bytes"] == exchange
    static = tmp_path / "static"
    run(RunConfig(**{**TINY, "compressor": "scatterq:bits=8"}, epochs=1, outer_steps=2,  # type: ignore[arg-type]
                  out=str(static)))
    sync = records(static)[-1]
    assert sync["rounds"] == 3 and sync["wire_bytes"] % 3 == 0
    wire = {r["step"]: r["wire_bytes"] for r in records(out) if r["kind"] == "step"}
    assert [wire[s] - wire[s - 1] for s in range(8, 19, 2)] == [sync["wire_bytes"] // 3] * 6
    assert all(wire[s] == wire[s - 1] for s in range(9, 19, 2))
    # Measured once: the state keeps the costs, and a later weighing issues no collective.
    state = json.loads((out / "summary.json").read_text())["auto_outer"]
    assert state["evaluations"] == 2
