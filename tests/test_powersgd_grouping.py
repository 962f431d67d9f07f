"""PowerSGD's result for a matrix depends on that matrix alone, bit for bit: not on which
other tensors share its call, their order, how many of its shape are batched with it, or where
its gradient lies in a bucket. DDP's buckets (rebuilt after a first step, hence different after
a resume) and a process group's layout (one worker per process, against the simulator's many)
group the same matrices differently, and each must give the same training run.

On the CPU, the BLAS rounds a product differently with the alignment in memory of its operands
and its output (a matrix starting 4 bytes further gives other bits), and LAPACK's QR likewise;
batched products on tiny matrices take another kernel than 2-D ones. The shapes below are
chosen to hit all of these: sizes that are not multiples of 16 entries, tiny matrices, a rank
of 2 with an odd number of rows.
"""

from __future__ import annotations

import random

import pytest
import torch

from gradzip import Engine, PowerSGD, SimulatedGroup
from gradzip.compressors.base import Job, StepContext

#: A small network's shapes, with neighbours that shift each other's alignment.
SHAPES = {
    "stem": (16, 3, 3, 3), "b1": (16,), "c1": (16, 16, 3, 3), "c2": (16, 16, 3, 3),
    "b2": (10,), "c3": (16, 16, 3, 3), "down": (32, 16, 1, 1), "c4": (32, 16, 3, 3),
    "c5": (32, 32, 3, 3), "t1": (8, 8), "t2": (8, 8), "t3": (10, 20), "odd": (101, 37),
    "odd2": (101, 37), "fc": (10, 64), "b3": (7,),
}
NAMES = list(SHAPES)


def _groupings() -> dict[str, list[list[list[str]]]]:
    """Per step, the calls of the step (lists of names). Every grouping covers every name once
    per step."""
    rng = random.Random(0)

    def pairs() -> list[list[str]]:
        names = NAMES[:]
        rng.shuffle(names)
        return [names[i:i + 2] for i in range(0, len(names), 2)]

    rest = [n for n in NAMES if n not in ("c1", "c2", "c3")]
    return {
        "each alone": [[[n] for n in NAMES]],
        "reversed": [[NAMES[::-1]]],
        "halves": [[NAMES[:7], NAMES[7:]], [NAMES[9:], NAMES[:9]]],
        "shuffled pairs": [pairs() for _ in range(2)],
        "batch sizes": [[["c1"], ["c2", "c3"], rest], [["c3", "c1"], ["c2"] + rest[::-1]]],
    }


def _run(comp: PowerSGD, calls_per_step: list[list[list[str]]], workers: int, steps: int = 2,
         bucket: bool = False) -> list[tuple[dict, dict]]:
    """``steps`` steps; each step's calls as given (cycling through the list). With
    ``bucket``, each call's gradients are views of one flat buffer in call order, after a
    lead of 3 entries (as DDP lays a bucket out), so a matrix's place depends on its
    neighbours."""
    gen = torch.Generator().manual_seed(11)
    state = comp.init_state({n: torch.Size(s) for n, s in SHAPES.items()})
    out = []
    for step in range(steps):
        grads = {n: torch.randn(workers, *s, generator=gen) for n, s in SHAPES.items()}
        got: dict[str, tuple[torch.Tensor, ...]] = {}
        for names in calls_per_step[step % len(calls_per_step)]:
            if bucket:
                flat = torch.zeros(workers, 3 + sum(grads[n][0].numel() for n in names))
                start, tensors = 3, []
                for n in names:
                    size = grads[n][0].numel()
                    view = flat[:, start:start + size].view(workers, *SHAPES[n])
                    view.copy_(grads[n])
                    tensors.append(view)
                    start += size
            else:
                tensors = [grads[n].clone() for n in names]
            jobs = [Job(n, t) for n, t in zip(names, tensors, strict=True)]
            comp.reduce(jobs, state, SimulatedGroup(workers),
                        StepContext(step, tuple(range(workers)), workers))
            for job in jobs:
                got[job.name] = (job.averaged.clone(), job.own_decoded().clone(),
                                 job.leftover().clone())
        out.append((got, {n: q.clone() for n, q in state["q"].items()}))
    return out


def _differences(got: list[tuple[dict, dict]], want: list[tuple[dict, dict]]) -> list[str]:
    bad = []
    for step, ((results, qs), (ref_results, ref_qs)) in enumerate(zip(got, want, strict=True)):
        for name in NAMES:
            for what, a, b in zip(("average", "decoded", "residual"), results[name],
                                  ref_results[name], strict=True):
                if not torch.equal(a, b):
                    bad.append(f"step {step} {name} {what}")
        assert qs.keys() == ref_qs.keys()
        bad += [f"step {step} {name} warm start" for name in qs if not torch.equal(qs[name], ref_qs[name])]
    return bad


@pytest.mark.parametrize(
    ("comp", "workers"),
    [(PowerSGD(matrix_rank=1), 3), (PowerSGD(matrix_rank=2), 1),
     (PowerSGD(matrix_rank=3, power_iterations=2), 3), (PowerSGD(matrix_rank=2, warm_start=False), 2)],
    ids=["rank1", "rank2", "rank3-two-iterations", "rank2-fresh"],
)
def test_results_do_not_depend_on_which_tensors_share_a_call(comp: PowerSGD, workers: int) -> None:
    """Every grouping gives the bits of all matrices in one call: averages, each worker's
    decoded message and residual, and the warm starts."""
    want = _run(comp, [[NAMES]], workers)
    for label, calls in _groupings().items():
        assert _differences(_run(comp, calls, workers), want) == [], label


@pytest.mark.parametrize("comp", [PowerSGD(matrix_rank=1), PowerSGD(matrix_rank=2)],
                         ids=["rank1", "rank2"])
def test_results_do_not_depend_on_where_a_gradient_lies_in_a_bucket(comp: PowerSGD) -> None:
    """Gradients as views of a bucket-like buffer (a matrix's address set by the tensors
    before it) give the bits of separate tensors, whatever the grouping."""
    want = _run(comp, [[NAMES]], 2)
    for label, calls in {"one bucket": [[NAMES]], **_groupings()}.items():
        assert _differences(_run(comp, calls, 2, bucket=True), want) == [], label


def test_one_worker_of_a_simulation_equals_a_process_of_its_own() -> None:
    """A process group holds one worker per process; the simulator holds them all in one
    tensor, so worker 1's matrices lie elsewhere in memory than worker 0's. Worker 1's own
    decoded message and residual equal those of a one-worker run on worker 1's gradients
    (with worker 0 sending zeros, the all-reduced factors are worker 1's, halved)."""
    comp = PowerSGD(matrix_rank=2)
    shapes = {n: torch.Size(s) for n, s in SHAPES.items()}
    gen = torch.Generator().manual_seed(5)
    grads = {n: torch.randn(1, *s, generator=gen) for n, s in shapes.items()}
    pair = [Job(n, torch.cat([torch.zeros_like(g), g])) for n, g in grads.items()]
    alone = [Job(n, g.clone()) for n, g in grads.items()]
    state = comp.init_state(shapes)
    comp.reduce(alone, state, SimulatedGroup(1), StepContext(0, (0,), 1))
    state = comp.init_state(shapes)
    comp.reduce(pair, state, SimulatedGroup(2), StepContext(0, (0, 1), 2))
    # The products that do not involve the average: P^T of worker 1 is its own; P then
    # differs only by the power-of-two factor 1/2 that orthogonalisation removes.
    for a, b in zip(alone, pair, strict=True):
        if comp.matrix_rank_for(a.tensor.shape[1:]):
            assert torch.equal(a.own_decoded()[0], b.own_decoded()[1]), a.name
            assert torch.equal(a.leftover()[0], b.leftover()[1]), a.name


def _engine_run(split: list[list[str]], steps: int = 3) -> list[dict[str, torch.Tensor]]:
    engine = Engine(SHAPES, "powersgd:rank=2", collective=SimulatedGroup(2))
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        grads = {n: torch.randn(2, *s, generator=gen) for n, s in SHAPES.items()}
        averaged: dict[str, torch.Tensor] = {}
        for i, names in enumerate(split):
            averaged.update(engine.reduce({n: grads[n] for n in names},
                                          finish_step=i == len(split) - 1))
        out.append(averaged)
    return out


def test_engine_runs_bucketed_differently_are_identical() -> None:
    """Two runs whose steps are cut into different calls (DDP buckets before and after a
    rebuild, or of another size) average every gradient to the same bits at every step."""
    one = _engine_run([NAMES])
    for split in ([NAMES[:5], NAMES[5:11], NAMES[11:]], [[n] for n in NAMES[::-1]]):
        other = _engine_run(split)
        for step, (a, b) in enumerate(zip(one, other, strict=True)):
            assert [n for n in NAMES if not torch.equal(a[n], b[n])] == [], step


@pytest.mark.parametrize("workers", [1, 3])
def test_two_ranks_in_one_exchange_equal_each_rank_alone(workers: int) -> None:
    # PowerSGD at two ranks (a two-level controller's levels) reduce their jobs in one
    # exchange: every average, residual and warm start as each level's own reduce gives it,
    # in two all-reduces instead of four, with the same payload.
    from gradzip.compressors.powersgd import reduce_together

    low, high = PowerSGD(matrix_rank=1), PowerSGD(matrix_rank=4, min_compression_rate=1.5)
    assert low.shares_exchange(high) and not low.shares_exchange(PowerSGD(power_iterations=2))
    names = {"low": NAMES[::2], "high": NAMES[1::2]}
    shapes = {n: torch.Size(SHAPES[n]) for n in NAMES}
    ctx = StepContext(step=0, ranks=tuple(range(workers)), world_size=workers)
    g = torch.Generator().manual_seed(workers)
    grads = {n: torch.randn(workers, *shapes[n], generator=g) for n in NAMES}
    apart_states = [c.init_group_state({n: shapes[n] for n in names[key]}, workers, workers)
                    for c, key in ((low, "low"), (high, "high"))]
    joint_states = [c.init_group_state({n: shapes[n] for n in names[key]}, workers, workers)
                    for c, key in ((low, "low"), (high, "high"))]
    for step in range(3):
        ctx = StepContext(step=step, ranks=tuple(range(workers)), world_size=workers)
        apart = {key: [Job(n, grads[n] * (step + 1)) for n in names[key]] for key in names}
        joint = {key: [Job(n, grads[n] * (step + 1)) for n in names[key]] for key in names}
        comm_apart, comm_joint = SimulatedGroup(workers), SimulatedGroup(workers)
        low.reduce(apart["low"], apart_states[0], comm_apart, ctx)
        high.reduce(apart["high"], apart_states[1], comm_apart, ctx)
        reduce_together([(low, joint["low"], joint_states[0]),
                         (high, joint["high"], joint_states[1])], comm_joint, ctx)
        for key in names:
            for a, b in zip(apart[key], joint[key], strict=True):
                assert torch.equal(a.averaged, b.averaged), (step, a.name)
                assert torch.equal(a.leftover(), b.leftover()), (step, a.name)
        for a_state, b_state in zip(apart_states, joint_states, strict=True):
            assert a_state["q"].keys() == b_state["q"].keys()
            assert all(torch.equal(a_state["q"][n], b_state["q"][n]) for n in a_state["q"])
        assert comm_joint.meter.payload == comm_apart.meter.payload
        assert comm_joint.meter.calls * 2 == comm_apart.meter.calls


@pytest.mark.parametrize("workers", [1, 3])
def test_powersgd_and_none_in_one_exchange_equal_each_alone(workers: int) -> None:
    # PowerSGD with ``none`` (a two-level controller whose gentle level is dense): the dense
    # level's tensors ride in PowerSGD's first message, two all-reduces instead of three,
    # every average and residual as each level's own reduce gives it.
    from gradzip.compressors.none import NoCompression
    from gradzip.compressors.powersgd import reduce_together

    low, high = PowerSGD(matrix_rank=2), NoCompression()
    assert low.shares_exchange(high)
    names = {"low": NAMES[::2], "high": NAMES[1::2]}
    shapes = {n: torch.Size(SHAPES[n]) for n in NAMES}
    g = torch.Generator().manual_seed(7 + workers)
    grads = {n: torch.randn(workers, *shapes[n], generator=g) for n in NAMES}
    states = {run: [c.init_group_state({n: shapes[n] for n in names[key]}, workers, workers)
                    for c, key in ((low, "low"), (high, "high"))] for run in ("apart", "joint")}
    for step in range(3):
        ctx = StepContext(step=step, ranks=tuple(range(workers)), world_size=workers)
        apart = {key: [Job(n, grads[n] * (step + 1)) for n in names[key]] for key in names}
        joint = {key: [Job(n, grads[n] * (step + 1)) for n in names[key]] for key in names}
        comm_apart, comm_joint = SimulatedGroup(workers), SimulatedGroup(workers)
        low.reduce(apart["low"], states["apart"][0], comm_apart, ctx)
        high.reduce(apart["high"], states["apart"][1], comm_apart, ctx)
        reduce_together([(low, joint["low"], states["joint"][0]),
                         (high, joint["high"], states["joint"][1])], comm_joint, ctx)
        for key in names:
            for a, b in zip(apart[key], joint[key], strict=True):
                assert torch.equal(a.averaged, b.averaged), (step, a.name)
                assert torch.equal(a.leftover(), b.leftover()), (step, a.name)
        assert all(torch.equal(states["apart"][0]["q"][n], states["joint"][0]["q"][n])
                   for n in states["apart"][0]["q"])
        assert comm_joint.meter.payload == comm_apart.meter.payload
        assert (comm_joint.meter.calls, comm_apart.meter.calls) == (2, 3)


def test_powersgd_without_a_matrix_makes_one_all_reduce() -> None:
    # Every tensor below the compression threshold: the dense tensors' message is the whole
    # exchange (no second, empty all-reduce).
    comp = PowerSGD(matrix_rank=4)
    shapes = {"b1": torch.Size((8,)), "b2": torch.Size((3, 2))}
    state = comp.init_group_state(shapes, 2, 2)
    comm = SimulatedGroup(2)
    jobs = [Job(n, torch.randn(2, *s)) for n, s in shapes.items()]
    comp.reduce(jobs, state, comm, StepContext(step=0, ranks=(0, 1), world_size=2))
    assert comm.meter.calls == 1
    for job in jobs:
        assert torch.equal(job.averaged, job.tensor.mean(0))


def test_accordion_with_powersgd_levels_takes_one_exchange_per_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The same run with the levels' joint exchange and without it: the same bits and level
    # counts, half the collectives in calls where both levels hold tensors.
    spec = "accordion(steady=powersgd:rank=1,critical=powersgd:rank=4,interval=2,eta=0.3)"

    def run() -> tuple[list[dict[str, torch.Tensor]], Engine]:
        engine = Engine({n: torch.Size(s) for n, s in SHAPES.items()}, spec,
                        collective=SimulatedGroup(2))
        g = torch.Generator().manual_seed(0)
        outs = []
        for step in range(8):
            grads = {n: torch.randn(2, *s, generator=g) * (1 + 3 * (step % 3 == 0))
                     for n, s in SHAPES.items()}
            outs.append(engine.reduce(grads))
        return outs, engine

    joint, joint_engine = run()
    monkeypatch.setattr(PowerSGD, "shares_exchange", lambda self, other: False)
    apart, apart_engine = run()
    for a, b in zip(apart, joint, strict=True):
        assert all(torch.equal(a[n], b[n]) for n in SHAPES)
    assert all(torch.equal(apart_engine.residuals[n], joint_engine.residuals[n])
               for n in apart_engine.residuals)
    counts = joint_engine.compressor.counts(joint_engine.compressor_state)
    assert counts == apart_engine.compressor.counts(apart_engine.compressor_state)
    assert counts["steady_steps"] > 0 and counts["critical_steps"] > 0
    assert joint_engine.stats["collective_calls"] < apart_engine.stats["collective_calls"]
    assert joint_engine.stats["payload_bytes"] == apart_engine.stats["payload_bytes"]
