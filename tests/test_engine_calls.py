"""Collectives per engine call: the header rides in the payload where the layout is guaranteed.

With ``same_layout=True`` (what the DDP hook passes) the call's fixed-size header travels as
a few extra elements of the call's first collective instead of an all-reduce of its own.
Counted here on the real groups (a simulated group, real gloo processes), with the results,
state and non-finite policies unchanged, and ranks out of step still caught on every rank.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

import gradzip
import shared_launch
from conformance import SHAPES, SPECS, make_grads
from gradzip.comm import run_processes
from gradzip.comm.header import HEADER_BYTES, rider_bytes, rider_digit_bits
from gradzip.comm.simulated import SimulatedGroup
from gradzip.comm.torch_dist import ProcessGroupCollective

OUT_OF_STEP = "ranks are out of step"
ALL_REDUCE_ONLY = ("none", "fp16", "bf16")


class CountingGroup(SimulatedGroup):
    """A real simulated group that counts the collectives it executes."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers)
        self.sums = self.gathers = 0

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        self.sums += 1
        return super()._sum(x)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        self.gathers += 1
        return super()._gather(x)

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        self.gathers += 1  # an all-to-all: counted with the gathers
        return super()._exchange(x)

    @property
    def count(self) -> int:
        return self.sums + self.gathers


class CountingProcessGroup(ProcessGroupCollective):
    """The real gloo collective, counting what it executes."""

    count = 0

    def _sum(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return super()._sum(x)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return super()._gather(x)

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return super()._exchange(x)


def _run(spec: str, same_layout: bool, steps: int = 3, workers: int = 3, **kw: Any) -> Any:
    group = CountingGroup(workers)
    engine = gradzip.Engine(SHAPES, spec, collective=group, **kw)
    names = list(SHAPES)
    outs, counts = [], []
    for step in range(steps):
        grads = make_grads(workers, step)
        parts = [names[:2], names[2:]]  # two calls a step, as two DDP buckets
        for i, part in enumerate(parts):
            before = group.count
            outs.append(engine.reduce({n: grads[n] for n in part}, finish_step=i == 1,
                                      same_layout=same_layout))
            counts.append(group.count - before)
    return engine, outs, counts


@pytest.mark.parametrize("spec", SPECS)
def test_same_layout_saves_one_collective_per_call_and_changes_no_result(spec: str) -> None:
    apart, outs_apart, counts_apart = _run(spec, same_layout=False)
    rides, outs_rides, counts_rides = _run(spec, same_layout=True)
    # Every exchange carries the header in its first message (an all-to-all in every part).
    assert [c - 1 for c in counts_apart] == counts_rides
    if spec in ALL_REDUCE_ONLY:
        assert counts_rides == [1] * len(counts_rides)  # the payload's all-reduce alone
    for a, b in zip(outs_apart, outs_rides, strict=True):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name  # bit-identical averages
    for name, rest in apart.residuals.items():
        assert torch.equal(rest, rides.residuals[name])
    assert apart.stats["dense_payload_bytes"] == rides.stats["dense_payload_bytes"]
    assert rides.stats["collective_calls"] == sum(counts_rides)


@pytest.mark.parametrize("spec", ALL_REDUCE_ONLY)
def test_the_riding_header_is_counted_as_the_bytes_it_is(spec: str) -> None:
    engine, _, counts = _run(spec, same_layout=True)
    dtype = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[spec]
    extra = rider_bytes(dtype, 3, summed=True)
    assert extra is not None
    payload = engine.stats["payload_bytes"][0]
    dense = engine.stats["dense_payload_bytes"][0]
    element = torch.empty((), dtype=dtype).element_size()
    assert payload == dense * element // 4 + len(counts) * extra


@pytest.mark.parametrize("policy", ["skip", "zero", "raise"])
@pytest.mark.parametrize("spec", ["none", "topk:ratio=0.05", "powersgd:rank=2", "sign"])
def test_policies_are_unchanged_when_the_header_rides(policy: str, spec: str) -> None:
    """A NaN in the second call of step 1 on one worker: same results, state and counters."""
    seen = []
    for same_layout in (False, True):
        engine = gradzip.Engine(SHAPES, spec, collective=SimulatedGroup(3), nonfinite=policy)
        names = list(SHAPES)
        results: list[Any] = []
        for step in range(3):
            grads = make_grads(3, step)
            if step == 1:
                grads["fc.weight"][2, 0, 0] = float("nan")
            try:
                for i, part in enumerate([names[:2], names[2:]]):
                    results.append(engine.reduce({n: grads[n] for n in part},
                                                 finish_step=i == 1, same_layout=same_layout))
            except FloatingPointError as err:
                results.append(str(err))
        seen.append((results, engine.state_dict()))
    (res_a, state_a), (res_b, state_b) = seen
    assert len(res_a) == len(res_b)
    for a, b in zip(res_a, res_b, strict=True):
        if isinstance(a, str):
            assert a == b
            continue
        for name in a:
            assert torch.equal(a[name].nan_to_num(7.0), b[name].nan_to_num(7.0)), name
    assert state_a["step"] == state_b["step"] and state_a["skipped_steps"] == state_b["skipped_steps"]
    for name, rest in state_a["residuals"].items():
        assert torch.equal(rest, state_b["residuals"][name])


def _exact_sum(rows: list[torch.Tensor]) -> torch.Tensor:
    """Sum in the rows' own dtype, in a shuffled order (any reduction order must be exact)."""
    order = list(range(len(rows)))
    random.Random(len(rows)).shuffle(order)
    total = rows[order[0]].clone()
    for i in order[1:]:
        total += rows[i]
    return total


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int64])
@pytest.mark.parametrize("world", [2, 3, 7, 64, 255])
def test_the_riding_digits_detect_any_disagreement_exactly(dtype: torch.dtype, world: int) -> None:
    from gradzip.comm.header import _digits

    bits = rider_digit_bits(dtype, world, summed=True)
    assert bits is not None
    gen = random.Random(world)

    def row(code: int) -> torch.Tensor:
        digits = _digits(code, bits)
        values = [v for d in digits for v in ((d, d * d) if bits > 1 else (d,))]
        return torch.tensor(values, dtype=dtype)

    def agreed(total: torch.Tensor) -> bool:
        sums = [int(v) for v in total.tolist()]
        step = 2 if bits > 1 else 1
        return all(world * sums[i + step - 1] == sums[i] ** 2 for i in range(0, len(sums), step))

    top = (1 << 24) - 1
    for code in (0, top, gen.randrange(top)):
        assert agreed(_exact_sum([row(code)] * world))
    for _ in range(40):
        codes = [gen.randrange(top + 1)] * world
        codes[gen.randrange(world)] = gen.randrange(top + 1)  # one rank differs (or not)
        assert agreed(_exact_sum([row(c) for c in codes])) == (len(set(codes)) == 1), codes
    # The worst case: every digit at its largest on every worker, still exact.
    total = _exact_sum([row(top)] * world)
    assert int(total[1 if bits > 1 else 0]) == world * (((1 << bits) - 1) ** (2 if bits > 1 else 1))


def test_a_header_that_cannot_ride_is_sent_apart_before_the_payload() -> None:
    """bf16 holds integers up to 256 only: with 300 workers the header travels apart."""
    assert rider_digit_bits(torch.bfloat16, 300, summed=True) is None
    group = CountingGroup(300)
    engine = gradzip.Engine({"w": torch.Size([4])}, "bf16", collective=group)
    out = engine.reduce({"w": torch.ones(300, 4)}, same_layout=True)
    assert group.count == 2 and torch.equal(out["w"], torch.ones(4))
    assert engine.stats["payload_bytes"][0] == 8 + HEADER_BYTES


# -- real gloo processes -------------------------------------------------------------------


def _mine(rank: int, world: int, step: int) -> dict[str, torch.Tensor]:
    return {n: g[rank] for n, g in make_grads(world, step).items()}


def _counted(rank: int, world: int, specs: list[str]) -> list[list[int]]:
    out = []
    for spec in specs:
        group = CountingProcessGroup()
        engine = gradzip.Engine(SHAPES, spec, collective=group)
        engine.reduce(_mine(rank, world, 0), same_layout=True)  # the handshake is one-off
        counts = []
        for step in range(1, 3):
            before = group.count
            engine.reduce(_mine(rank, world, step), same_layout=True)
            counts.append(group.count - before)
        out.append(counts)
    return out


def _out_of_step(rank: int, world: int, case: str) -> dict[str, Any]:
    engine = gradzip.Engine(SHAPES, "none")
    names = list(SHAPES)
    try:
        for step in range(4):
            if case == "skipped step" and rank == 1 and step == 1:
                continue
            grads = _mine(rank, world, step)
            if case == "skipped step":
                engine.reduce(grads, step=step, same_layout=True)
                continue
            # Two calls of equal layout a step; rank 0 drops the first call of step 1.
            parts = [names[2:3], names[2:3]]
            if case == "skipped call" and rank == 0 and step == 1:
                parts = parts[1:]
            for i, part in enumerate(parts):
                engine.reduce({n: grads[n] for n in part}, finish_step=i == len(parts) - 1,
                              same_layout=True)
        message = "no error"
    except RuntimeError as err:
        message = str(err)
    return {"message": message, "step": engine.state_dict()["step"]}


shared_launch.register(2, "engine_calls", _counted,
                       ["none", "fp16", "bf16", "topk:ratio=0.05", "powersgd:rank=2"],
                       timeout=120)


@pytest.mark.slow
def test_gloo_all_reduce_only_engines_make_one_collective_per_call(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    # Launched with the other modules' workers of this world size (see shared_launch).
    for per_rank in shared_launch.results(2, "engine_calls", tmp_path_factory):
        assert per_rank == [[1, 1], [1, 1], [1, 1], [2, 2], [2, 2]], per_rank


@pytest.mark.slow
@pytest.mark.parametrize("case", ["skipped step", "skipped call"])
def test_ranks_out_of_step_are_caught_on_every_rank_when_the_header_rides(case: str) -> None:
    results = run_processes(_out_of_step, 2, case, timeout=120)
    for result in results:
        assert result["message"].startswith(OUT_OF_STEP), result
    assert results[0]["step"] == results[1]["step"] == 1  # the step was abandoned everywhere
