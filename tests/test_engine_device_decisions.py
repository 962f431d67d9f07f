"""Non-finite decisions kept on the device give what the host decision gives, bit for bit.

On CUDA, engines whose compressor declares ``device_decisions`` (none, fp16, bf16, randk,
powersgd, topk, qsgd, sign) keep the non-finite flag of each call as a device tensor and
apply the policy with ``torch.where``, so the host never waits per call (``tests/test_cuda.py`` checks that with
``torch.cuda.set_sync_debug_mode("error")``). Here the same path is forced on the CPU
(``decide_on="device"``) and compared with the host path (``decide_on="host"``): same averages, residuals,
compressor state and skipped-step counts, through NaN gradients, overflows, several calls
per step, both policies, the header apart or riding; and ranks out of step are still caught
on every rank in real gloo processes (at the end of the step).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gradzip
import shared_launch
from conformance import SHAPES, make_grads
from gradzip.comm.simulated import SimulatedGroup, SingleWorker
from gradzip.spec import compressor_from_spec

DEVICE_SPECS = ["none", "fp16", "bf16", "randk:ratio=0.1", "powersgd:rank=2", "powersgd:rank=1",
                "topk:ratio=0.05", "topk:ratio=0.05,exchange=sharded", "qsgd:levels=4", "sign",
                "threshold:lam=0.5,capacity=0.05", "threshold:lam=2.5,capacity=0.01"]
NAMES = list(SHAPES)


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [x for key in sorted(tree) for x in _leaves(tree[key])]
    return [tree]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    return a == b


def _train(spec: str, policy: str, same_layout: bool, workers: int, on_device: bool) -> Any:
    group = SingleWorker() if workers == 1 else SimulatedGroup(workers)
    engine = gradzip.Engine(SHAPES, spec, collective=group, nonfinite=policy,
                            decide_on="device" if on_device else "host")
    results = []
    for step in range(6):
        grads = make_grads(workers, step)
        if workers == 1:
            grads = {n: g[0] for n, g in grads.items()}
        if step in (2, 4):  # a NaN in the step's second call
            grads["fc.weight"].view(-1)[5] = float("nan")
        if step == 3:  # finite, but overflows in compression
            grads["conv.weight"].view(-1)[0] = 3e38
        for i, part in enumerate([NAMES[:2], NAMES[2:]]):
            results.append(engine.reduce({n: grads[n] for n in part}, finish_step=i == 1,
                                         same_layout=same_layout))
    pending = engine._skips.pending is not None
    return results, engine.state_dict(), pending


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("same_layout", [False, True], ids=["apart", "riding"])
@pytest.mark.parametrize("policy", ["skip", "zero"])
@pytest.mark.parametrize("spec", DEVICE_SPECS)
def test_device_decisions_equal_host_decisions(
    spec: str, policy: str, same_layout: bool, workers: int
) -> None:
    host, host_state, host_pending = _train(spec, policy, same_layout, workers, on_device=False)
    dev, dev_state, dev_pending = _train(spec, policy, same_layout, workers, on_device=True)
    assert dev_pending and not host_pending  # the device path was really taken
    assert len(host) == len(dev)
    for a, b in zip(host, dev, strict=True):
        assert a.keys() == b.keys()
        assert all(_same(a[n], b[n]) for n in a)
    assert host_state["skipped_steps"] == dev_state["skipped_steps"] >= 2
    assert host_state["residuals"].keys() == dev_state["residuals"].keys()
    for name, rest in host_state["residuals"].items():
        assert torch.equal(rest, dev_state["residuals"][name]), name
    host_leaves, dev_leaves = _leaves(host_state["compressor_state"]), _leaves(dev_state["compressor_state"])
    assert len(host_leaves) == len(dev_leaves)
    assert all(_same(a, b) for a, b in zip(host_leaves, dev_leaves, strict=True))


def test_device_decisions_count_the_header_like_the_host_path_in_finite_steps() -> None:
    for spec in DEVICE_SPECS:
        stats = []
        for on_device in (False, True):
            engine = gradzip.Engine(SHAPES, spec, collective=SimulatedGroup(2),
                                    decide_on="device" if on_device else "host")
            for step in range(3):
                engine.reduce(make_grads(2, step))
            stats.append(engine.stats)
        assert stats[0] == stats[1], spec


@pytest.mark.parametrize("spec", ["threshold:budget=0.05", "threshold:lam=2.5",
                                  "threshold:budget=0.05,capacity=0.1"])
def test_compressors_that_read_the_host_anyway_keep_host_decisions(spec: str) -> None:
    assert not compressor_from_spec(spec).device_decisions
    engine = gradzip.Engine(SHAPES, spec, collective=SimulatedGroup(2), decide_on="device")
    for step in range(2):
        engine.reduce(make_grads(2, step))
    assert engine._skips.pending is None


def test_raise_keeps_host_decisions() -> None:
    engine = gradzip.Engine(SHAPES, "none", collective=SimulatedGroup(2), nonfinite="raise",
                            decide_on="device")
    grads = make_grads(2, 0)
    grads["scale"][1] = float("inf")
    with pytest.raises(FloatingPointError):
        engine.reduce(grads)
    assert engine.state_dict()["step"] == 0


def test_decide_on_is_validated_where_given_and_where_set() -> None:
    with pytest.raises(ValueError, match="^`decide_on` must be one of 'auto', 'host', 'device', got 'gpu'$"):
        gradzip.Engine(SHAPES, "none", collective=SimulatedGroup(2), decide_on="gpu")
    with pytest.raises(TypeError, match="^`decide_on` must be a string, got True"):
        gradzip.Engine(SHAPES, "none", collective=SimulatedGroup(2), decide_on=True)
    engine = gradzip.Engine(SHAPES, "none", collective=SimulatedGroup(2))
    assert engine.decide_on == "auto"
    with pytest.raises(ValueError, match="`decide_on` must be one of"):
        engine.decide_on = "cpu"
    assert engine.decide_on == "auto"


def test_decide_on_host_keeps_every_decision_on_the_host() -> None:
    # Off CUDA "auto" decides on the host too; "host" must hold even where "device" is asked
    # for first and then taken back.
    engine = gradzip.Engine(SHAPES, "powersgd:rank=2", collective=SimulatedGroup(2),
                            decide_on="device")
    engine.decide_on = "host"
    for step in range(3):
        engine.reduce(make_grads(2, step))
    assert engine._skips.pending is None
    engine.decide_on = "device"
    engine.reduce(make_grads(2, 3))
    assert engine._skips.pending is not None


# -- real gloo processes -------------------------------------------------------------------


def _mine(rank: int, world: int, step: int) -> dict[str, torch.Tensor]:
    return {n: g[rank] for n, g in make_grads(world, step).items()}


def _device_path_out_of_step(rank: int, world: int, spec: str) -> dict[str, Any]:
    engine = gradzip.Engine(SHAPES, spec, decide_on="device")
    outcome = "no error"
    try:
        for step in range(4):
            if rank == 1 and step == 1:
                continue  # this rank skips a whole step of the loop
            grads = _mine(rank, world, step)
            for i, part in enumerate([NAMES[:2], NAMES[2:]]):
                engine.reduce({n: grads[n] for n in part}, finish_step=i == 1, step=step,
                              same_layout=True)
    except RuntimeError as err:
        outcome = str(err)
    return {"message": outcome, "step": engine.state_dict()["step"]}


def _device_path_nonfinite(rank: int, world: int, spec: str) -> list[Any]:
    engine = gradzip.Engine(SHAPES, spec, decide_on="device")
    seen = []
    for step in range(4):
        grads = _mine(rank, world, step)
        if rank == 1 and step == 2:
            grads["scale"][0] = float("nan")
        outs = [engine.reduce({n: grads[n] for n in part}, finish_step=i == 1, same_layout=True)
                for i, part in enumerate([NAMES[:2], NAMES[2:]])]
        seen.append([bool(torch.isnan(v).all()) for out in outs for v in out.values()])
    seen.append(engine.stats["skipped_steps"])
    return seen


def _device_paths(rank: int, world: int, specs: list[str]) -> dict[str, Any]:
    """Both scenarios for every spec, in one set of processes (a launch costs more than the
    scenarios; the out-of-step one fails on every rank at the same call, so the collectives
    stay matched for the next)."""
    return {spec: (_device_path_out_of_step(rank, world, spec),
                   _device_path_nonfinite(rank, world, spec)) for spec in specs}


# PowerSGD's header rides in an all-reduce; Top-k's and Sign's in an all-gather.
DEVICE_SPECS = ["powersgd:rank=2", "topk:ratio=0.05", "sign"]


shared_launch.register(2, "device_paths", _device_paths, DEVICE_SPECS)


@pytest.fixture(scope="module")
def device_paths(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    # Launched with the other modules' workers of this world size (see shared_launch).
    return shared_launch.results(2, "device_paths", tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("spec", DEVICE_SPECS)
def test_device_decisions_in_real_processes(device_paths: list[dict[str, Any]], spec: str) -> None:
    for result, _ in (ranks[spec] for ranks in device_paths):
        # Found at the end of the step (one host read a step), on every rank.
        assert result["message"].startswith("ranks are out of step"), result
        assert "Found at the step's end" in result["message"]  # no host read per call
        assert result["step"] == 1
    first, second = (ranks[spec][1] for ranks in device_paths)
    assert first == second
    assert first[2] == [False, False, True, True]  # the second call of step 2 and after
    assert first[-1] == 1


@pytest.mark.parametrize("policy", ["skip", "zero"])
@pytest.mark.parametrize("spec", ["none", "topk:ratio=0.05", "powersgd:rank=2"])
def test_a_host_call_after_a_non_finite_device_call_of_the_step_keeps_its_decision(
    spec: str, policy: str
) -> None:
    # The step's first call decides on the device and is non-finite; its second call decides
    # on the host. The device decision must count (skipped steps, and for "skip" the NaN of
    # the later call), exactly as if the whole step had decided on the host.
    outcomes = []
    for mixed in (False, True):
        engine = gradzip.Engine(SHAPES, spec, collective=SimulatedGroup(2), nonfinite=policy,
                                decide_on="device" if mixed else "host")
        results = []
        for step in range(4):
            grads = make_grads(2, step)
            if step == 2:
                grads[NAMES[0]].view(2, -1)[1, 0] = float("nan")  # in the first call
            for i, part in enumerate([NAMES[:2], NAMES[2:]]):
                if mixed:
                    engine.decide_on = "host" if (step == 2 and i == 1) else "device"
                results.append(engine.reduce({n: grads[n] for n in part}, finish_step=i == 1))
        outcomes.append((results, engine.state_dict()))
    (host, host_state), (mixed_results, mixed_state) = outcomes
    assert host_state["skipped_steps"] == mixed_state["skipped_steps"] == 1
    for a, b in zip(host, mixed_results, strict=True):
        assert all(_same(a[n], b[n]) for n in a)
    for name, rest in host_state["residuals"].items():
        assert torch.equal(rest, mixed_state["residuals"][name]), name
    assert all(_same(a, b) for a, b in zip(_leaves(host_state["compressor_state"]),
                                            _leaves(mixed_state["compressor_state"]), strict=True))


def _mixed_step(order: tuple[str, str], bad: tuple[bool, bool]) -> gradzip.Engine:
    """A finite step, then one whose two calls decide where ``order`` says (``bad``: which
    calls are non-finite), then a finite step."""
    engine = gradzip.Engine(SHAPES, "powersgd:rank=2", collective=SimulatedGroup(2),
                            nonfinite="zero", decide_on="host")
    engine.reduce(make_grads(2, 0))  # every tensor gets a residual: the device path applies
    grads = make_grads(2, 1)
    for i, (where, part) in enumerate(zip(order, [NAMES[:2], NAMES[2:]], strict=True)):
        if bad[i]:
            grads[part[0]].view(-1)[0] = float("nan")
        engine.decide_on = where
        engine.reduce({n: grads[n] for n in part}, finish_step=i == 1)
    engine.decide_on = order[0]
    engine.reduce(make_grads(2, 2))
    return engine


@pytest.mark.parametrize("bad", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("order", [("host", "device"), ("device", "host")])
def test_a_step_with_host_and_device_decisions_counts_once(
    order: tuple[str, str], bad: tuple[bool, bool],
) -> None:
    """Under ``zero``, a step whose calls decide in both places is one skipped step,
    whichever decides first and whichever is non-finite (a host decision and a device one,
    both non-finite, used to count two), and it adds nothing to the compression error, as
    when both calls decide on the host."""
    engine = _mixed_step(order, bad)
    reference = _mixed_step(("host", "host"), bad)
    assert engine.stats["skipped_steps"] == reference.stats["skipped_steps"] == 1
    assert engine.compression_error() == reference.compression_error()
