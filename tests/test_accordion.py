"""Accordion and the batch-size controller: the rule, construction, decisions on synthetic norm
sequences, learning-rate drops, a small training run. Accordion's state across bucketed calls,
switches and checkpoints is tested in test_accordion_state.py."""

from __future__ import annotations

import io
import logging

import pytest
import torch

from gradzip import Engine, PowerSGD, SimulatedGroup
from gradzip.control import (
    Accordion,
    BatchSizeController,
    critical_regime,
    decide,
    is_lr_drop,
    joint_norm,
)

C, S = "critical", "steady"
#: gradzip's first rule, kept as options: whole adjacent intervals of the averaged gradient
#: that was sent, a drop holding until the interval's end.
FIRST_RULE = {"signal": "sent", "lr_hold": "boundary"}


# -- the pure rule ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prev", "curr", "critical", "change"),
    [
        (1.0, 1.0, False, 0.0),
        (1.0, 1.49, False, 0.49),
        (1.0, 1.5, True, 0.5),  # the boundary is critical (>= eta)
        (2.0, 1.0, True, 0.5),
        (2.0, 0.0, True, 1.0),
        (0.0, 3.0, True, None),  # a zero previous norm counts as critical
        (0.0, 0.0, True, None),
        (None, 1.0, True, None),
        (1.0, float("inf"), True, None),
    ],
)
def test_critical_regime(prev: float | None, curr: float, critical: bool, change: float | None) -> None:
    got, rel = critical_regime(prev, curr, 0.5)
    assert got is critical
    assert rel == pytest.approx(change) if change is not None else rel is None


def test_rule_reasons_and_validation() -> None:
    assert decide(None, 1.0, 0.5).reason == "first"
    assert decide(1.0, 1.1, 0.5).reason == "steady" and decide(1.0, 1.1, 0.5).level == S
    assert decide(1.0, 3.0, 0.5).reason == "norm_change" and decide(1.0, 3.0, 0.5).level == C
    dropped = decide(1.0, 1.0, 0.5, lr_dropped=True)
    assert (dropped.level, dropped.reason, dropped.rel_change) == (C, "lr_drop", 0.0)
    with pytest.raises(ValueError, match=r"`eta` must be > 0, got 0.0"):
        critical_regime(1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="`curr_norm` must be >= 0"):
        critical_regime(1.0, -1.0, 0.5)
    assert is_lr_drop(0.1, 0.01) and not is_lr_drop(0.1, 0.0995) and not is_lr_drop(None, 0.1)
    assert joint_norm([torch.full((4,), 1.0), torch.full((9,), 1.0)]) == pytest.approx(13**0.5)


# -- construction -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        ({"eta": 0}, ValueError, "`eta` must be > 0, got 0.0"),
        ({"eta": -0.5}, ValueError, "`eta` must be > 0, got -0.5"),
        ({"interval": 0}, ValueError, "`interval` must be >= 1, got 0"),
        ({"interval": 2.5}, TypeError, "`interval` must be an integer, got 2.5"),
        ({"per_layer": 1}, TypeError, "`per_layer` must be a bool, got 1"),
        ({"critical": "topk:ratio=0.1"}, ValueError,
         "`critical` must be the same kind of compressor as `steady` (powersgd) or 'none', got 'topk:ratio=0.1'"),
        ({"critical": 4}, TypeError, "`critical` must be a Compressor or a spec string"),
        ({"steady": Accordion("topk:ratio=0.1", "none")}, TypeError, "`steady` must be a plain compressor"),
        ({"critical": "powersgd:rank=0"}, ValueError, "`matrix_rank` must be >= 1, got 0"),
    ],
)
def test_accordion_validates(kwargs: dict, exc: type, message: str) -> None:
    args = {"steady": "powersgd:rank=1", "critical": "powersgd:rank=4", **kwargs}
    with pytest.raises(exc) as info:
        Accordion(**args)
    assert message in str(info.value)


def test_spec_round_trip_and_bias(caplog: pytest.LogCaptureFixture) -> None:
    acc = Accordion("powersgd:rank=1", "powersgd:rank=4", 0.5, 100)
    spec = ("accordion(steady=powersgd:rank=1,critical=powersgd:rank=4,eta=0.5,interval=100,"
            "per_layer=True,lr_drop=True,window=10,signal=raw,lr_hold=interval)")
    assert acc.spec() == spec == str(acc)
    assert Accordion.parse(spec) == acc
    nested = Accordion(PowerSGD(matrix_rank=1, power_iterations=2), "none", interval=7, per_layer=False)
    assert Accordion.parse(nested.spec()) == nested
    assert acc.biased and Accordion("topk:ratio=0.01", "none").biased
    assert not Accordion("qsgd:levels=2", "qsgd:levels=16").biased
    assert not Accordion("fp16", "none").biased
    with pytest.raises(ValueError, match="must look like 'accordion"):
        Accordion.parse("topk:ratio=0.1")
    with caplog.at_level(logging.WARNING):
        Accordion("topk:ratio=0.5", "topk:ratio=0.01")  # swapped levels: legal, but warned
    assert "looks more aggressive" in caplog.text


# -- explicit-state tests on synthetic norm sequences -------------------------------------------
def run_norms(scales: dict[str, list[float]], interval: int, *, per_layer: bool = True,
              extra_steps: int = 0) -> tuple[Engine, list[dict[str, str]]]:
    """Feed tensor ``n`` the gradient ``scales[n][k] * direction`` in every step of interval
    ``k`` (exact levels, one worker: the accumulated norm is ``interval * scale``), under the
    first rule (whole intervals). Returns the engine and the levels in force during each
    interval (plus after the last decision)."""
    shapes = {n: torch.Size([3, 4]) for n in scales}
    acc = Accordion("topk:ratio=1.0", "none", interval=interval, per_layer=per_layer,
                    window=interval, **FIRST_RULE)
    engine = Engine(shapes, acc, collective=SimulatedGroup(1))
    gen = torch.Generator().manual_seed(0)
    dirs = {n: torch.randn(1, 3, 4, generator=gen) for n in scales}
    dirs = {n: d / d.norm() for n, d in dirs.items()}
    count = len(next(iter(scales.values())))
    seen = []
    for step in range(count * interval + extra_steps):
        if step % interval == 0:
            seen.append(Accordion.levels(engine))
        k = min(step // interval, count - 1)
        engine.reduce({n: scales[n][k] * dirs[n] for n in scales})
    seen.append(Accordion.levels(engine))
    return engine, seen


SEQ_A = [1.0, 1.0, 1.2, 3.0, 3.1, 3.0, 1.0]
SEQ_B = [2.0, 0.0, 0.0, 5.0, 5.0, 5.0, 5.0]


@pytest.mark.parametrize("interval", [1, 3])
def test_per_layer_decisions_on_a_norm_sequence(interval: int) -> None:
    engine, seen = run_norms({"a": SEQ_A, "b": SEQ_B}, interval)
    # Intervals 0 and 1 are critical ("first"); then interval k+1 follows from k vs k-1.
    assert [s["a"] for s in seen] == [C, C, S, S, C, S, S, C]
    assert [s["b"] for s in seen] == [C, C, C, C, C, S, S, S]  # zero norms count as critical
    last = {r["name"]: r for r in Accordion.decisions(engine)}
    assert last["a"]["reason"] == "norm_change" and last["a"]["rel_change"] == pytest.approx(2 / 3, rel=1e-5)
    assert last["b"]["reason"] == "steady" and last["b"]["rel_change"] == pytest.approx(0, abs=1e-6)
    assert last["a"]["step"] == 7 * interval and last["a"]["interval"] == 7
    assert last["a"]["norm"] == pytest.approx(interval * 1.0, rel=1e-5)
    assert last["a"]["prev_norm"] == pytest.approx(interval * 3.0, rel=1e-5)
    counts = Accordion.counts(engine)
    assert counts["decisions"] == 8  # the initial one and seven interval ends
    assert len(engine.compressor_state["controller"]["log"]) == 2 * 8  # LOG_POINTS points kept
    assert counts["switches"] == 4 + 1
    assert counts["critical"] + counts["steady"] == 2 * 8
    assert counts["critical"] == 5 + 5 - 1  # per-tensor choices; the last interval is unrun
    assert counts["reasons"]["first"] == 4 and counts["reasons"]["lr_drop"] == 0
    # Tensor-steps run at each level: a was critical in 3 of the 7 intervals run, b in 5.
    assert counts["critical_steps"] == (3 + 5) * interval
    assert counts["steady_steps"] == (4 + 2) * interval


def test_model_level_decisions_use_the_joint_norm() -> None:
    engine, seen = run_norms({"a": SEQ_A, "b": SEQ_B}, 3, per_layer=False)
    # Joint norms: 2.24, 1, 1.2, 5.83, 5.88, 5.83, 5.10.
    assert [s["a"] for s in seen] == [C, C, C, S, C, S, S, S]
    assert all(s["a"] == s["b"] for s in seen)
    (record,) = Accordion.decisions(engine)
    assert record["name"] == "model" and record["level"] == S
    assert record["rel_change"] == pytest.approx(1 - 26**0.5 / 34**0.5, rel=1e-5)


def test_partial_interval_takes_no_decision() -> None:
    full, _ = run_norms({"a": SEQ_A}, 3)
    longer, seen = run_norms({"a": SEQ_A}, 3, extra_steps=2)  # 23 steps: not a multiple
    assert Accordion.decisions(longer) == Accordion.decisions(full)
    ctrl = longer.compressor_state["controller"]
    assert ctrl["step"] == 23 and ctrl["interval"] == 7
    assert ctrl["acc"]["a"].norm().item() == pytest.approx(2.0, rel=1e-5)  # two steps of 1.0
    assert ctrl["next"] == 24


# -- learning-rate drops ------------------------------------------------------------------------
def lr_engine(interval: int = 4, **kwargs: object) -> tuple[Engine, torch.optim.SGD]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    kwargs = {"window": interval, **FIRST_RULE, **kwargs}
    acc = Accordion("topk:ratio=0.25", "none", interval=interval, **kwargs)
    engine = Engine({"w": torch.Size([8, 8]), "b": torch.Size([8])}, acc,
                    collective=SimulatedGroup(2), optimizer=opt)
    return engine, opt


def constant_grads(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return {"w": 1 + 0.01 * torch.randn(2, 8, 8, generator=gen), "b": torch.ones(2, 8)}


def test_lr_drop_forces_critical_until_the_interval_end() -> None:
    engine, opt = lr_engine()
    for step in range(13):
        engine.reduce(constant_grads(step))
    assert set(Accordion.levels(engine).values()) == {S}  # steady from step 8 on
    opt.param_groups[0]["lr"] = 0.01  # a step schedule's drop, seen mid-interval
    engine.reduce(constant_grads(13), finish_step=False)  # a DDP hook: several calls a step
    assert set(Accordion.levels(engine).values()) == {C}
    engine.reduce({}, finish_step=True)
    records = Accordion.decisions(engine)
    assert [(r["reason"], r["step"], r["level"]) for r in records] == [("lr_drop", 13, C)] * 2
    assert Accordion.counts(engine)["reasons"]["lr_drop"] == 2  # recorded once per tensor
    engine.reduce(constant_grads(14))
    assert set(Accordion.levels(engine).values()) == {C}
    engine.reduce(constant_grads(15))  # the interval's end: the norm rule decides again
    assert {r["reason"] for r in Accordion.decisions(engine)} <= {"steady", "norm_change"}
    # A drop seen in an interval's last step: two decision points in one step, both kept.
    for step in range(16, 19):
        engine.reduce(constant_grads(step))
    seen = Accordion.counts(engine)["decisions"]
    opt.param_groups[0]["lr"] = 0.001
    engine.reduce(constant_grads(19))
    points = Accordion.decisions(engine, since=seen)
    assert [(r["decision"], r["reason"], r["step"]) for r in points][::2] == [
        (seen, "lr_drop", 19), (seen + 1, points[-1]["reason"], 20)]
    assert Accordion.decisions(engine) == points[2:]


@pytest.mark.parametrize("how", ["small_decrease", "disabled", "explicit"])
def test_lr_drop_variants(how: str) -> None:
    engine, opt = lr_engine(lr_drop=how != "disabled")
    for step in range(13):
        engine.reduce(constant_grads(step))
    if how == "small_decrease":
        opt.param_groups[0]["lr"] = 0.099  # one step of a smooth schedule: not a drop
    elif how == "disabled":
        opt.param_groups[0]["lr"] = 0.001
    else:
        Accordion.signal_lr_drop(engine)  # no optimizer needed
    engine.reduce(constant_grads(13))
    expected = C if how == "explicit" else S
    assert set(Accordion.levels(engine).values()) == {expected}


# -- a small training run in the simulator ------------------------------------------------------
def train_least_squares(compressor: object, steps: int = 160, drop_at: int = 80,
                        interval: int = 10) -> tuple[Engine, list[str], float]:
    """SGD on a least-squares problem (a 32x16 weight), 4 simulated workers with their own
    data, learning rate divided by 10 at ``drop_at``. Returns the engine, the level in force
    during each interval, and the final loss."""
    workers, dim_in, dim_out, rows, batch = 4, 32, 16, 512, 16
    gen = torch.Generator().manual_seed(0)
    truth = torch.randn(dim_in, dim_out, generator=gen)
    x = torch.randn(workers, rows, dim_in, generator=gen)
    y = x @ truth + 0.5 * torch.randn(workers, rows, dim_out, generator=gen)
    weight = torch.zeros(dim_in, dim_out)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.2)  # holds the LR
    engine = Engine({"w": weight.shape}, compressor, collective=SimulatedGroup(workers), optimizer=opt)
    sampler = torch.Generator().manual_seed(1)
    levels = []
    for step in range(steps):
        if step == drop_at:
            opt.param_groups[0]["lr"] = 0.02
        idx = torch.randint(0, rows, (workers, batch), generator=sampler)
        xb = torch.gather(x, 1, idx[..., None].expand(-1, -1, dim_in))
        yb = torch.gather(y, 1, idx[..., None].expand(-1, -1, dim_out))
        grad = xb.transpose(1, 2) @ (xb @ weight - yb) / batch
        weight = weight - opt.param_groups[0]["lr"] * engine.reduce({"w": grad})["w"]
        if isinstance(engine.compressor, Accordion) and step % interval == 0:
            levels.append(Accordion.levels(engine)["w"])
    return engine, levels, float(((x @ weight - y) ** 2).mean())


@pytest.mark.slow
def test_training_log_shows_critical_regimes_and_bytes_fall_between_levels() -> None:
    acc = Accordion("topk:ratio=0.05", "topk:ratio=0.25", interval=10, window=10, **FIRST_RULE)
    engine, levels, loss = train_least_squares(acc)
    # Critical while the loss falls fast and right after the LR drop (interval 8: forced;
    # interval 9: the accumulated norm jumps), steady in between and afterwards.
    assert "".join(lv[0] for lv in levels) == "ccccssssccssssss"
    assert Accordion.decisions(engine)[0]["reason"] == "steady"
    reasons = Accordion.counts(engine)["reasons"]
    assert reasons["lr_drop"] == 1 and reasons["first"] == 2 and reasons["norm_change"] == 3
    low, _, low_loss = train_least_squares("topk:ratio=0.05")
    high, _, high_loss = train_least_squares("topk:ratio=0.25")
    sent = engine.stats["payload_bytes"][0]
    assert low.stats["payload_bytes"][0] < sent < high.stats["payload_bytes"][0]
    assert loss < 0.3 and high_loss < 0.3  # noise floor: 0.25


# -- the batch-size controller ------------------------------------------------------------------
def batch_controller(**kwargs: object) -> BatchSizeController:
    args = {"small": 512, "large": 4096, "micro_batch": 64, "workers": 4, "interval_samples": 4096}
    args.update(kwargs)
    return BatchSizeController(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        ({"small": 500}, ValueError, "`small` must be a multiple of micro_batch * workers = 256, got 500"),
        ({"large": 256}, ValueError, "`large` must be >= 512, got 256"),
        ({"eta": 0.0}, ValueError, "`eta` must be > 0, got 0.0"),
        ({"interval_samples": 0}, ValueError, "`interval_samples` must be >= 1, got 0"),
        ({"workers": 2.0}, TypeError, "`workers` must be an integer, got 2.0"),
    ],
)
def test_batch_controller_validates(kwargs: dict, exc: type, message: str) -> None:
    with pytest.raises(exc) as info:
        batch_controller(**kwargs)
    assert message in str(info.value)


def feed(ctl: BatchSizeController, scales: list[float], base_lr: float = 0.1) -> list[int]:
    """Run whole intervals; in interval ``k`` every step's mean gradient is ``scales[k] * e``.
    Returns the batch size used in each interval."""
    direction = torch.zeros(10)
    direction[0] = 1.0
    used = []
    for scale in scales:
        used.append(ctl.begin_step(base_lr).batch_size)
        while not ctl.end_step([scale * direction]):
            ctl.begin_step(base_lr)
    return used


def test_batch_controller_rule_plan_and_counts() -> None:
    ctl = batch_controller()
    plan = ctl.begin_step(0.1)
    assert (plan.batch_size, plan.micro_batches, plan.lr, plan.level) == (512, 2, 0.1, C)
    used = feed(ctl, [1.0, 1.0, 1.1, 3.0, 3.0, 3.0])
    assert used == [512, 512, 4096, 4096, 512, 4096]
    plan = ctl.begin_step(0.1)
    assert (plan.batch_size, plan.micro_batches, plan.lr) == (4096, 16, pytest.approx(0.8))
    # 8 rounds of 512 per critical interval, 1 round of 4096 per steady one.
    assert ctl.rounds == 3 * 8 + 3 * 1 and ctl.samples == 6 * 4096
    assert ctl.counts == {"critical_rounds": 24, "steady_rounds": 3, "switches": 3}
    assert [d["reason"] for d in ctl.decisions] == ["first", "first", "steady", "steady",
                                                    "norm_change", "steady", "steady"]
    assert ctl.decisions[-1]["norm"] == pytest.approx(3.0)  # the interval's mean gradient
    ctl.begin_step(0.01)  # a drop of the schedule's (unscaled) rate: small batches at once
    assert (ctl.batch_size, ctl.decisions[-1]["reason"]) == (512, "lr_drop")


def test_batch_controller_state_dict_round_trip_mid_interval() -> None:
    scales = [1.0, 1.0, 1.1, 3.0, 3.0, 3.0, 2.9, 0.5]
    straight = batch_controller(interval_samples=8192)
    feed(straight, scales)
    first = batch_controller(interval_samples=8192)
    feed(first, scales[:3])
    first.begin_step(0.1)
    first.end_step([torch.full((10,), 0.3)])  # mid-interval
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = batch_controller(interval_samples=8192)
    resumed.load_state_dict(torch.load(buffer, weights_only=False))
    assert torch.equal(resumed.state["acc"]["0"], first.state["acc"]["0"])
    with pytest.raises(ValueError, match="`interval_samples` of the checkpoint must be 4096"):
        batch_controller().load_state_dict(first.state_dict())
    # Continue both from the same point: identical decisions.
    first.end_step([torch.full((10,), 0.3)])
    resumed.end_step([torch.full((10,), 0.3)])
    assert resumed.state_dict()["state"]["log"] == first.state_dict()["state"]["log"]
    assert resumed.rounds == first.rounds and resumed.samples == first.samples


@pytest.mark.parametrize("hold", ["interval", "boundary"])
def test_batch_controller_drop_holds_like_accordion(hold: str) -> None:
    ctl = batch_controller(interval_samples=8192, lr_hold=hold)
    feed(ctl, [1.0, 1.0, 1.0])
    assert ctl.level == S  # steady intervals are 2 rounds of 4096
    e0 = torch.zeros(10)
    e0[0] = 1.0
    ctl.begin_step(0.1)
    ctl.end_step([5.0 * e0])  # half an interval of a larger gradient
    ctl.begin_step(0.01)  # the drop, mid-interval
    rounds = 1
    while not ctl.end_step([e0]):
        ctl.begin_step(0.01)
        rounds += 1
    last = ctl.decisions[-1]
    if hold == "interval":
        # A whole interval of small batches (16 x 512) after the drop, compared with the last
        # interval before it: the same gradient, so steady.
        assert rounds == 16 and last["reason"] == "steady"
        assert last["norm"] == pytest.approx(last["prev_norm"])
    else:
        # Until the current interval ends (8 x 512), its sum mixing both sides of the drop.
        assert rounds == 8 and last["reason"] == "norm_change"
