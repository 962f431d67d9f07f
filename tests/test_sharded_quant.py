"""The sharded quantised exchange: identities on both sides, exact bytes, grouping
independence, exact resume, the decision rule, and real gloo processes against the simulator."""

from __future__ import annotations

import functools
import io
from typing import Any

import pytest
import torch

import gloo_parity
import gradzip
from gradzip.comm.base import allgather_wire_bytes, allreduce_wire_bytes
from gradzip.comm.header import HEADER_BYTES, rider_bytes
from gradzip.compressors.base import Job, StepContext
from gradzip.compressors.sharded_codes import choose_exchange, shard_size, sharded_wire_bytes
from gradzip.feedback import residual_after

# Sizes that divide by no world size below (short last parts, empty parts at W=8 for "odd").
SHAPES = {"w": torch.Size([30, 41]), "v": torch.Size([777]), "odd": torch.Size([13])}
SPECS = ["qsgd:levels=4,exchange=sharded", "qsgd:levels=2,bucket_size=64,exchange=sharded",
         "sign:exchange=sharded", "binmean:bits=2,exchange=sharded", "scatterq:bits=4"]


def _grads(workers: int, step: int, shapes: dict[str, torch.Size] = SHAPES) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * workers + step)
    return {n: torch.randn(workers, *s, generator=gen) for n, s in shapes.items()}


def _ctx(workers: int, step: int) -> StepContext:
    return StepContext(step=step, ranks=tuple(range(workers)), world_size=workers)


def _codec(compressor: Any) -> Any:
    return getattr(compressor, "codec", compressor)


@pytest.mark.parametrize("workers", [2, 4, 8])
@pytest.mark.parametrize("spec", SPECS)
def test_both_error_feedback_identities_hold_exactly(spec: str, workers: int) -> None:
    """Worker side: residual == compensated - own decoded message. Owner side, per part:
    (rank-order sum of the decoded pieces) / W + old owner residual == the decoded
    re-encoding every worker receives + new owner residual."""
    compressor = gradzip.compressor_from_spec(spec)
    comm = gradzip.SimulatedGroup(workers)
    state = compressor.init_group_state(SHAPES, workers, workers)
    sharded = [n for n, f in state["forms"].items() if f == "sharded"]
    assert sharded  # every tensor of these specs but the tiny one at scatterq
    if spec.startswith("qsgd"):  # unbiased: no owner residual (see sharded_reduce)
        assert state["owner"] == {}
        sharded = []
    for step in range(3):
        old = {n: state["owner"][n].clone() for n in sharded}
        jobs = [Job(n, g) for n, g in _grads(workers, step).items()]
        compressor.reduce(jobs, state, comm, _ctx(workers, step))
        for job in jobs:
            assert torch.equal(job.leftover(), residual_after(job.tensor, job.own_decoded()))
            if job.name not in sharded:
                continue
            c = shard_size(job.numel, workers)
            pieces = torch.nn.functional.pad(job.own_decoded().reshape(workers, -1),
                                             (0, workers * c - job.numel))
            total = pieces[0].clone()
            for w in range(1, workers):
                total += pieces[w]
            target = total.div_(workers).reshape(workers, c) + old[job.name]
            got = torch.nn.functional.pad(job.averaged.reshape(-1), (0, workers * c - job.numel))
            assert torch.equal(state["owner"][job.name], target - got.reshape(workers, c))
            # Past the tensor's end the owner residual stays zero.
            assert not state["owner"][job.name].reshape(-1)[job.numel :].any()
        if step and sharded:
            assert any(state["owner"][n].abs().sum() > 0 for n in sharded)
    if spec.startswith("qsgd"):
        assert state["owner"] == {}


def _part_bytes(compressor: Any, numel: int, workers: int) -> int:
    return _codec(compressor).part_bytes(shard_size(numel, workers))


@pytest.mark.parametrize("workers", [2, 4, 8])
@pytest.mark.parametrize("spec", ["qsgd:levels=4,exchange=sharded", "sign:exchange=sharded",
                                  "binmean:bits=2,exchange=sharded"])
def test_wire_and_payload_bytes_are_the_formula(spec: str, workers: int) -> None:
    compressor = gradzip.compressor_from_spec(spec)
    comm = gradzip.SimulatedGroup(workers)
    jobs = [Job(n, g) for n, g in _grads(workers, 0).items()]
    compressor.reduce(jobs, compressor.init_group_state(SHAPES, workers, workers), comm,
                      _ctx(workers, 0))
    part = sum(_part_bytes(compressor, s.numel(), workers) for s in SHAPES.values())
    assert comm.meter.wire == [2 * (workers - 1) * part] * workers
    assert comm.meter.payload == [(workers + 1) * part] * workers
    assert comm.meter.calls == 2
    assert sum(sharded_wire_bytes(_codec(compressor), s.numel(), workers)
               for s in SHAPES.values()) == 2 * (workers - 1) * part
    # With the engine and the header riding in every part of the all-to-all.
    engine = gradzip.Engine(SHAPES, spec, collective=gradzip.SimulatedGroup(workers))
    engine.reduce(_grads(workers, 0), same_layout=True)
    extra = rider_bytes(torch.uint8, workers, summed=False)
    assert extra == 4
    assert engine.stats["wire_bytes"] == [(workers - 1) * (part + extra) + (workers - 1) * part] * workers
    assert engine.stats["payload_bytes"] == [workers * (part + extra) + part] * workers
    # Apart, the header is its own all-reduce.
    engine = gradzip.Engine(SHAPES, spec, collective=gradzip.SimulatedGroup(workers))
    engine.reduce(_grads(workers, 0))
    assert engine.stats["wire_bytes"] == [
        allreduce_wire_bytes(HEADER_BYTES, workers) + 2 * (workers - 1) * part] * workers


@pytest.mark.parametrize("spec", ["qsgd:levels=4", "sign", "binmean:bits=2"])
def test_auto_takes_the_form_with_fewest_wire_bytes(spec: str) -> None:
    compressor = gradzip.compressor_from_spec(spec)
    codec = _codec(compressor)
    seen = set()
    for workers in (1, 2, 3, 8, 64, 512):
        for numel in (1, 7, 100, 1000, 65536):
            form = choose_exchange(codec, "auto", numel, workers)
            seen.add(form)
            if workers == 1:
                assert form == "allgather"
                continue
            cost = {"allgather": allgather_wire_bytes(codec.part_bytes(numel), workers),
                    "sharded": sharded_wire_bytes(codec, numel, workers),
                    "dense": allreduce_wire_bytes(4 * numel, workers)}
            assert cost[form] == min(cost.values()), (workers, numel, form, cost)
            assert choose_exchange(codec, "allgather", numel, workers) == "allgather"
            assert choose_exchange(codec, "sharded", numel, workers) == "sharded"
    assert seen == {"allgather", "sharded", "dense"}


def test_exchange_is_validated_and_named() -> None:
    with pytest.raises(ValueError, match="`exchange` must be one of 'auto', 'allgather', 'sharded', got 'ring'"):
        gradzip.compressor_from_spec("qsgd:exchange=ring")
    with pytest.raises(TypeError, match="`exchange`"):
        gradzip.Sign(exchange=3)  # type: ignore[arg-type]
    assert gradzip.compressor_from_spec("sign:exchange=sharded").spec() == "sign:exchange=sharded"
    assert gradzip.compressor_from_spec("binmean").spec() == "binmean"


@pytest.mark.parametrize("spec", ["qsgd:levels=4", "sign", "binmean:bits=2", "scatterq"])
def test_one_call_or_several_give_the_same_bits(spec: str) -> None:
    """A tensor's parts, scales and owner sums are its own: how tensors share calls (DDP's
    buckets, which may differ after a resume) changes nothing."""
    workers = 4
    together = gradzip.Engine(SHAPES, spec, collective=gradzip.SimulatedGroup(workers))
    apart = gradzip.Engine(SHAPES, spec, collective=gradzip.SimulatedGroup(workers))
    names = list(SHAPES)
    for step in range(3):
        grads = _grads(workers, step)
        one = together.reduce(grads)
        many = {}
        for i, name in enumerate(reversed(names)):
            many.update(apart.reduce({name: grads[name]}, finish_step=i == len(names) - 1))
        for name in names:
            assert torch.equal(one[name], many[name]), (step, name)
    for name, rest in together.residuals.items():
        assert torch.equal(rest, apart.residuals[name])
    for name, owner in together.compressor_state["owner"].items():
        assert torch.equal(owner, apart.compressor_state["owner"][name])


@pytest.mark.parametrize("spec", ["qsgd:levels=4,exchange=sharded", "sign", "binmean:bits=2"])
def test_state_dict_mid_run_resumes_bit_for_bit(spec: str) -> None:
    workers = 8
    straight = gradzip.Engine(SHAPES, spec, collective=gradzip.SimulatedGroup(workers))
    expected = [straight.reduce(_grads(workers, s)) for s in range(5)]
    first = gradzip.Engine(SHAPES, spec, collective=gradzip.SimulatedGroup(workers))
    for s in range(2):
        first.reduce(_grads(workers, s))
    owners = first.compressor_state["owner"].values()
    assert spec.startswith("qsgd") or any(o.abs().sum() > 0 for o in owners)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = gradzip.Engine(SHAPES, spec, collective=gradzip.SimulatedGroup(workers))
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for s in range(2, 5):
        got = resumed.reduce(_grads(workers, s))
        for name in SHAPES:
            assert torch.equal(got[name], expected[s][name]), (s, name)
    assert resumed.stats == straight.stats
    report = resumed.compressor.report(resumed.compressor_state)
    assert report["exchange"] == straight.compressor.report(straight.compressor_state)["exchange"]


def test_a_state_of_another_world_size_is_refused() -> None:
    spec = "sign:exchange=sharded"
    saved = gradzip.Engine(SHAPES, spec, collective=gradzip.SimulatedGroup(4)).state_dict()
    other = gradzip.Engine(SHAPES, spec, collective=gradzip.SimulatedGroup(4))
    state = other.compressor.init_group_state(SHAPES, 2, 4)
    assert other.compressor.check_state(saved["compressor_state"], fresh=state, shapes=SHAPES,
                                        workers=4) is None  # the forms agree; shapes do not
    with pytest.raises(ValueError, match="owner"):
        bad = dict(saved)
        bad["compressor_state"] = state
        other.load_state_dict(bad)
    forms = dict(saved["compressor_state"]["forms"])
    forms["w"] = "dense"
    fresh = other.compressor.init_group_state(SHAPES, 4, 4)
    found = other.compressor.check_state({"forms": forms, "owner": {}}, fresh=fresh,
                                         shapes=SHAPES, workers=4)
    assert found == "forms.w: must be 'sharded', got 'dense'"


@pytest.mark.parametrize("spec", ["qsgd:levels=4,exchange=sharded", "sign:exchange=sharded"])
def test_device_decisions_path_gives_the_host_paths_bits(spec: str) -> None:
    """The header rides in the all-to-all, checked on the device: no host read of the flags,
    the same results; a non-finite gradient is handled alike on both paths."""
    workers = 4
    outs = {}
    for decide_on in ("host", "device"):
        engine = gradzip.Engine(SHAPES, spec, collective=gradzip.SimulatedGroup(workers),
                                decide_on=decide_on, nonfinite="skip")
        got = []
        for step in range(4):
            grads = _grads(workers, step)
            if step == 2:
                grads["v"][1, 5] = float("nan")
            got.append(engine.reduce(grads, same_layout=True))
        outs[decide_on] = (got, engine)
    (host, h), (device, d) = outs["host"], outs["device"]
    for a, b in zip(host, device, strict=True):
        for name in SHAPES:  # the skipped step's results are NaN on both paths
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, equal_nan=True)
    assert h.stats["skipped_steps"] == d.stats["skipped_steps"] == 1
    for name, owner in h.compressor_state["owner"].items():
        assert torch.equal(owner, d.compressor_state["owner"][name])


GLOO_SHAPES = {"w": torch.Size([30, 41]), "v": torch.Size([777])}
GLOO_SPECS = ["qsgd:levels=4", "sign", "binmean:bits=2", "scatterq:bits=4",
              "sign:exchange=allgather"]
GLOO_STEPS = 3


def _report(engine: Any, workers: int) -> Any:
    return engine.compressor.report(engine.compressor_state)


for _spec in GLOO_SPECS:
    gloo_parity.register(f"sharded_quant:{_spec}", gloo_parity.Case(
        GLOO_SHAPES, _spec, functools.partial(_grads, shapes=GLOO_SHAPES), steps=GLOO_STEPS,
        same_layout=True, probe=_report))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [3, 4])
def test_gloo_processes_match_the_simulator_bit_for_bit(world_size: int) -> None:
    for spec in GLOO_SPECS:
        key = f"sharded_quant:{spec}"
        sim, expected = gloo_parity.simulate(gloo_parity.CASES[key], world_size)
        report = sim.compressor.report(sim.compressor_state)
        if not spec.endswith("allgather"):
            assert report["exchange"]["sharded"] == 2, (spec, report)
        for rank, real in enumerate(gloo_parity.results(world_size, key)):
            assert real["probe"] == report  # the same decision on every rank
            for step in range(GLOO_STEPS):
                for name in GLOO_SHAPES:
                    assert torch.equal(real["results"][step][name], expected[step][name]), (
                        spec, rank, step, name)
            for key_ in ("payload_bytes", "wire_bytes", "dense_payload_bytes", "dense_wire_bytes"):
                assert real["stats"][key_] == [sim.stats[key_][rank]], (spec, key_)
            for name, res in real["residuals"].items():
                assert torch.equal(res, sim.residuals[name][rank]), (spec, name)
            for name, owner in real["owner"].items():
                assert torch.equal(owner, sim.compressor_state["owner"][name][rank]), (spec, name)


def test_codes_of_more_rows_than_a_packing_chunk_round_trip() -> None:
    """Parts are many short rows (W workers x W parts in the simulator): packing must take
    more rows than its in-cache chunk holds."""
    from gradzip.ops.bits import _SPREAD_CHUNK, pack_bits, unpack_bits

    gen = torch.Generator().manual_seed(3)
    for bits in (3, 4):
        codes = torch.randint(0, 1 << bits, (_SPREAD_CHUNK + 5, 12), generator=gen,
                              dtype=torch.uint8)
        packed = pack_bits(codes, bits)
        assert torch.equal(unpack_bits(packed, bits, 12), codes)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["sign:exchange=sharded", "binmean:bits=2,exchange=sharded",
                                  "qsgd:levels=8,bucket_size=64,exchange=sharded"])
def test_two_sided_error_feedback_delivers_a_fixed_gradient(spec: str) -> None:
    """Over many steps of one gradient, what the owners' re-encodings hold back is sent
    later: the mean of the averages approaches the true mean (error feedback on both sides;
    QSGD, unbiased, without either: its averages are unbiased, their mean converges)."""
    workers, steps = 8, 300
    engine = gradzip.Engine(SHAPES, spec, collective=gradzip.SimulatedGroup(workers))
    grads = _grads(workers, 0)
    total = {n: torch.zeros(s) for n, s in SHAPES.items()}
    for _ in range(steps):
        for name, avg in engine.reduce(grads).items():
            total[name] += avg
    for name in SHAPES:
        want = grads[name].mean(0)
        rel = float((total[name] / steps - want).norm() / want.norm())
        assert rel < 0.1, (spec, name, rel)
