"""Accordion's default rule, the paper code's, on synthetic norm sequences with explicit state:
a window of steps before each decision, the raw local gradient, a whole interval held after
a learning-rate drop, tensors dense at both levels left out of the records."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from gradzip import Engine, SimulatedGroup
from gradzip.control import Accordion

C, S, D = "critical", "steady", "dense"
EXACT = ("topk:ratio=1.0", "none")  # both levels exact, yet neither known to be dense


def direction(seed: int, shape: tuple[int, ...] = (3, 4)) -> torch.Tensor:
    d = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return d / d.norm()


def drive(acc: Accordion, scale: Callable[[int], float], steps: int, *, workers: int = 1,
          drop_at: int | None = None) -> tuple[Engine, list[str]]:
    """One tensor ``a`` whose gradient at step ``t`` is ``scale(t) * direction`` on every
    worker; the learning rate falls tenfold at ``drop_at``. Returns the engine and the level
    ``a`` was reduced at in each step."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    engine = Engine({"a": torch.Size([3, 4])}, acc, collective=SimulatedGroup(workers), optimizer=opt)
    unit = direction(0).expand(workers, 3, 4)
    used = []
    for t in range(steps):
        if t == drop_at:
            opt.param_groups[0]["lr"] = 0.01
        engine.reduce({"a": scale(t) * unit}, finish_step=False)
        used.append(Accordion.levels(engine)["a"])  # the level this step is reduced at
        engine.reduce({}, finish_step=True)
    return engine, used


def table(values: dict[tuple[int, int], float], default: float = 1.0) -> Callable[[int], float]:
    """A step -> scale function from ``{(first, last_exclusive): scale}``."""
    def scale(t: int) -> float:
        return next((v for (a, b), v in values.items() if a <= t < b), default)
    return scale


def test_default_window_is_a_tenth_of_the_interval() -> None:
    assert Accordion(*EXACT, interval=25).window == 3
    assert Accordion(*EXACT, interval=4).window == 1
    with pytest.raises(ValueError, match=r"`window` must be in \[1, 4\], got 5"):
        Accordion(*EXACT, interval=4, window=5)
    with pytest.raises(ValueError, match="`signal` must be one of"):
        Accordion(*EXACT, signal="averaged")
    with pytest.raises(ValueError, match="`lr_hold` must be one of"):
        Accordion(*EXACT, lr_hold="epoch")


def test_window_before_each_decision_is_compared_with_the_one_an_interval_earlier() -> None:
    # Interval 4, window 2: decisions after 2, 6, 10, 14 steps, each summing the last two.
    # Steps 2-3 and 6-7 lie outside every window: their large changes are not seen.
    scale = table({(2, 4): 10.0, (4, 6): 1.2, (6, 8): 0.1, (8, 14): 3.0, (14, 16): 3.1}, 1.0)
    engine, used = drive(Accordion(*EXACT, interval=4, window=2), scale, 16)
    assert used == [C] * 6 + [S] * 4 + [C] * 4 + [S] * 2
    records = [r for r in engine.compressor_state["controller"]["log"] if r["norm"] is not None]
    assert [(r["step"], r["reason"]) for r in records] == [
        (2, "first"), (6, "steady"), (10, "norm_change"), (14, "steady")]
    assert [r["norm"] for r in records] == pytest.approx([2.0, 2.4, 6.0, 6.0], rel=1e-6)
    assert [r["prev_norm"] for r in records[1:]] == pytest.approx([2.0, 2.4, 6.0], rel=1e-6)
    # Whole adjacent intervals (window = interval) see the jumps and decide otherwise.
    _, whole = drive(Accordion(*EXACT, interval=4, window=4), scale, 16)
    assert whole != used


def test_a_decision_due_is_taken_at_the_next_reduce_with_one_small_all_reduce() -> None:
    acc = Accordion(*EXACT, interval=2, window=1)
    engine = Engine({"a": torch.Size([3, 4]), "b": torch.Size([5])}, acc, collective=SimulatedGroup(2))
    grads = {"a": torch.ones(2, 3, 4), "b": torch.ones(2, 5)}
    engine.reduce(grads)  # the first decision falls due after one step
    ctrl = engine.compressor_state["controller"]
    assert int(ctrl["step"]) == ctrl["next"] and ctrl["interval"] == 0  # due, not taken yet
    before = engine.stats["payload_bytes"][0]
    engine.reduce(grads)
    ctrl = engine.compressor_state["controller"]
    assert int(ctrl["step"]) < ctrl["next"] and ctrl["interval"] == 1
    # The step's dense exchange (17 floats, the critical level), the engine's call header
    # (three int64: fingerprint, its square, non-finite count) and the decision's two float64
    # norms.
    assert engine.stats["payload_bytes"][0] - before == 17 * 4 + 3 * 8 + 2 * 8


def test_the_raw_local_gradient_is_judged_and_worker_norms_are_averaged() -> None:
    # Two workers with gradients of norms 1 and 3: the decision norm is their mean, 2.
    shapes = {"a": torch.Size([8, 8])}
    gen = torch.Generator().manual_seed(3)
    acc = Accordion("topk:ratio=0.05", "topk:ratio=0.1", interval=3, window=1)
    sent = Accordion("topk:ratio=0.05", "topk:ratio=0.1", interval=3, window=1, signal="sent")
    engines = [Engine(shapes, a, collective=SimulatedGroup(2)) for a in (acc, sent)]
    for _ in range(5):
        g = torch.randn(2, 8, 8, generator=gen)
        g = g / g.flatten(1).norm(dim=1)[:, None, None] * torch.tensor([1.0, 3.0])[:, None, None]
        for engine in engines:
            engine.reduce({"a": g})
    raw_norms = [r["norm"] for r in engines[0].compressor_state["controller"]["log"] if r["norm"]]
    sent_norms = [r["norm"] for r in engines[1].compressor_state["controller"]["log"] if r["norm"]]
    assert raw_norms == pytest.approx([2.0, 2.0], rel=1e-6)  # decisions after steps 1 and 4
    # What was sent (5-10% of the entries of an error-compensated average) is another quantity.
    assert all(abs(n - 2.0) > 0.2 for n in sent_norms) and len(sent_norms) == 2


def test_model_level_raw_norm_is_the_mean_of_each_workers_joint_norm() -> None:
    acc = Accordion(*EXACT, interval=2, window=1, per_layer=False)
    engine = Engine({"a": torch.Size([3, 4]), "b": torch.Size([2, 2])}, acc, collective=SimulatedGroup(2))
    a = torch.stack([3 * direction(1), 6 * direction(1)])
    b = torch.stack([4 * direction(2, (2, 2)), 8 * direction(2, (2, 2))])
    engine.reduce({"a": a, "b": b})
    engine.reduce({"a": a, "b": b})
    (record,) = Accordion.decisions(engine)
    assert record["name"] == "model" and record["norm"] == pytest.approx((5 + 10) / 2, rel=1e-6)


@pytest.mark.parametrize("drop_at", [6, 8, 10])
def test_a_drop_holds_every_tensor_critical_for_one_whole_interval(drop_at: int) -> None:
    # Interval 4, window 1: decisions after 1, 5, 9, ... steps; constant gradients make them
    # steady. A drop restarts the grid: critical for exactly 4 steps whatever the norms do
    # meanwhile, then a decision comparing the step before it with the last window before the
    # drop (both of scale 1, so steady).
    scale = table({(drop_at + 1, drop_at + 3): 7.0}, 1.0)
    engine, used = drive(Accordion(*EXACT, interval=4, window=1), scale, drop_at + 6, drop_at=drop_at)
    assert used[5:drop_at] == [S] * (drop_at - 5)
    assert used[drop_at:drop_at + 4] == [C] * 4
    assert used[drop_at + 4:] == [S] * 2
    log = engine.compressor_state["controller"]["log"]
    drop = [r for r in log if r["reason"] == "lr_drop"]
    assert [r["step"] for r in drop] == [drop_at]
    after = [r for r in log if r["step"] > drop_at and r["norm"] is not None]
    assert [(r["step"], r["reason"]) for r in after] == [(drop_at + 4, "steady")]
    assert after[0]["norm"] == pytest.approx(1.0) and after[0]["prev_norm"] == pytest.approx(1.0)


def test_first_rule_holds_only_until_the_interval_end() -> None:
    # The same drop on an interval's last step under lr_hold="boundary": one step critical,
    # then the regular decision compares a window that mixes the drop's neighbourhood.
    scale = table({(9, 11): 7.0}, 1.0)
    _, used = drive(Accordion(*EXACT, interval=4, window=1, lr_hold="boundary"), scale, 14,
                    drop_at=8)
    assert used[8] == C and used[9:] == [S] * 5


def test_signal_lr_drop_holds_a_whole_interval_too() -> None:
    engine, _ = drive(Accordion(*EXACT, interval=4, window=1), table({}), 7)
    assert Accordion.levels(engine)["a"] == S
    Accordion.signal_lr_drop(engine)
    Accordion.signal_lr_drop(engine)  # twice between the same steps: one drop
    ctrl = engine.compressor_state["controller"]
    assert Accordion.levels(engine)["a"] == C and ctrl["next"] == 7 + 4
    assert Accordion.counts(engine)["reasons"]["lr_drop"] == 1


def test_tensors_dense_at_both_levels_take_no_decision_and_are_not_counted_gentle() -> None:
    shapes = {"w": torch.Size([16, 12]), "b": torch.Size([16])}
    gen = torch.Generator().manual_seed(5)
    for levels, dense in ((("powersgd:rank=1", "powersgd:rank=4"), {"b"}),
                          (("powersgd:rank=1", "none"), {"b"}),
                          (("topk:ratio=0.1", "none"), set())):
        engine = Engine(shapes, Accordion(*levels, interval=2, window=1), collective=SimulatedGroup(2))
        for _ in range(6):
            engine.reduce({"w": torch.randn(2, 16, 12, generator=gen),
                           "b": torch.randn(2, 16, generator=gen)})
        levels_now = Accordion.levels(engine)
        assert {n for n, lv in levels_now.items() if lv == D} == dense, levels
        names = {r["name"] for r in engine.compressor_state["controller"]["log"]}
        assert names == set(shapes) - dense, levels
        counts = Accordion.counts(engine)
        assert counts["dense_steps"] == 6 * len(dense)
        assert counts["critical_steps"] + counts["steady_steps"] == 6 * (2 - len(dense))


def test_the_runner_picks_either_rule_and_reads_older_summaries_as_the_first() -> None:
    from gradzip.train.runner import RunConfig, build_compressor, resolve_config

    base = {"task": "digits", "compressor": "topk:ratio=0.1", "accordion": "topk:ratio=0.5",
            "interval_epochs": 2.0, "out": "unused"}
    reference = build_compressor(resolve_config(RunConfig.from_dict(base)), 30)
    assert (reference.interval, reference.window, reference.signal, reference.lr_hold) == (
        60, 30, "raw", "interval")  # one epoch summed before each decision
    first = build_compressor(resolve_config(RunConfig.from_dict({**base, "accordion_rule": "first"})), 30)
    assert (first.window, first.signal, first.lr_hold) == (60, "sent", "boundary")
    with pytest.raises(ValueError, match="`accordion_rule` must be one of"):
        resolve_config(RunConfig.from_dict({**base, "accordion_rule": "paper"}))
    # A summary written before the option existed: Accordion ran the first rule; without
    # Accordion the option changes nothing and is not part of the result key.
    old = RunConfig.from_dict(base).to_dict()
    del old["accordion_rule"]
    assert RunConfig.from_stored(old).accordion_rule == "first"
    static = {**old, "accordion": None}
    assert RunConfig.from_stored(static).result_key() == RunConfig.from_dict(
        {**base, "accordion": None}).result_key()
