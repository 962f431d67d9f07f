"""The flat bucket path (``none``, ``fp16``, ``bf16`` behind the DDP hook) against the ordinary
engine path, in real gloo groups.

One group of 3 processes runs every scenario (three, so that a ring all-reduce's summation
order depends on where each element sits in the message). The ordinary path
(``decide_on="host"``) is the reference: the flat path must give the same gradients,
parameters, counters and errors bit for bit, with one and several buckets, in both hook modes,
and with a NaN or an overflowing value in one rank's bucket under every non-finite policy.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip.ddp
import shared_launch
from ddp_helpers import TINY_BUCKET_MB, batch, chain, flat_params, train_ddp
from gradzip import Engine
from gradzip.comm.torch_dist import ProcessGroupCollective

WORLD = 3
SPECS = ("none", "fp16", "bf16")
CAPS = {"one": 25.0, "several": TINY_BUCKET_MB}
MODES = {"async": {}, "sync": {"overlap": False}}
POLICIES = ("skip", "zero", "raise")
#: Compressors of the ordinary path whose decisions may stay on the device: their buckets'
#: averages go back by one multi-tensor copy and the policy's mask is applied to the whole
#: bucket buffer at once.
GENERIC_SPECS = ("topk:ratio=0.2", "powersgd:rank=1")
#: Written into one parameter's gradient: a NaN on rank 1 only, and on every rank a finite
#: value whose sum overflows fp32 (and which, divided by the world size, overflows fp16).
INJECTED = {"nan": float("nan"), "huge": 3e38}


def _flat(on: bool | str) -> Any:
    """Setup: ``True`` the flat path (host form on the CPU), ``"device"`` its device form,
    ``False`` the ordinary host path."""
    def setup(model: nn.Module, opt: Any, state: Any) -> None:
        state.engine.decide_on = on if isinstance(on, str) else "auto" if on else "host"
    return setup


def _took_flat_path(state: Any, every: bool = True) -> bool:
    """Whether every bucket (or, ``every=False``, at least one) went the flat path."""
    used = [layout.message is not None for _, layout in state._layouts.values()]
    return bool(used) and (all(used) if every else any(used))


def _faulty_run(rank: int, spec: str, cap: float, policy: str, value: float, flat: bool | str,
                overlap: bool) -> dict[str, Any]:
    """Four steps; at step 1 the gradient of one parameter (one bucket of several) is filled
    with ``value``: on rank 1 for a NaN, on every rank otherwise. The optimizer steps only on
    finite gradients."""
    model = chain(5)
    ddp = DDP(model, bucket_cap_mb=cap)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = gradzip.ddp.register(ddp, spec, optimizer=opt, nonfinite=policy, overlap=overlap)
    state.engine.decide_on = flat if isinstance(flat, str) else "auto" if flat else "host"
    target = list(model.parameters())[1]
    grads, errors, stats = [], [], []
    for step in range(4):
        handle = None
        if step == 1 and (rank == 1 or not math.isnan(value)):
            handle = target.register_hook(lambda g: torch.full_like(g, value))
        opt.zero_grad()
        x, y = batch(step, rank)
        try:
            nn.functional.mse_loss(ddp(x), y).backward()
        except (RuntimeError, FloatingPointError) as exc:
            errors.append(str(exc).splitlines()[0])
            break
        finally:
            if handle is not None:
                handle.remove()
        grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        grads.append(grad)
        stats.append(state.stats)
        if torch.isfinite(grad).all():
            opt.step()
    return {"grads": grads, "errors": errors, "stats": stats, "params": flat_params(model),
            "flat": _took_flat_path(state, every=False)}


def _padded_buffer(rank: int, transposed: bool) -> dict[str, Any]:
    """The engine's bucket call on views that do not tile their buffer (a gap between them;
    with ``transposed``, one view is not contiguous), against ``reduce`` of the same
    gradients."""
    shapes = {"a": torch.Size([3, 4]), "b": torch.Size([5])}
    out = {}
    for spec in SPECS:
        engines = [Engine(shapes, spec, collective=ProcessGroupCollective()) for _ in range(2)]
        buffer = torch.randn(20, generator=torch.Generator().manual_seed(rank))
        a = buffer[8:20].view(4, 3).t() if transposed else buffer[8:20].view(3, 4)
        named = {"b": buffer[0:5].view(5), "a": a}
        expected = engines[1].reduce({n: g.clone() for n, g in named.items()}, same_layout=True)
        layout = engines[0].bucket_layout(named, buffer)
        engines[0].reduce_bucket(layout, finish_step=True)
        out[spec] = {
            "whole": layout.whole,
            "flat": layout.message is not None,
            "same": all(torch.equal(named[n], expected[n]) for n in shapes),
            "gap_untouched": torch.equal(
                buffer[5:8], torch.randn(20, generator=torch.Generator().manual_seed(rank))[5:8]
            ),
            "stats": engines[0].stats == engines[1].stats,
        }
    return out


def _out_of_step_on_device(rank: int) -> dict[str, Any]:
    """Two buckets of a step with decisions on the device, rank 1 calling with another step
    number: caught at the step's last bucket, on every rank, the step abandoned."""
    shapes = {"a": torch.Size([3, 4]), "b": torch.Size([5])}
    engine = Engine(shapes, "fp16", collective=ProcessGroupCollective(), decide_on="device")
    buffers = [torch.randn(12), torch.randn(5)]
    layouts = [engine.bucket_layout({"a": buffers[0].view(3, 4)}, buffers[0]),
               engine.bucket_layout({"b": buffers[1]}, buffers[1])]
    engine.reduce_bucket(layouts[0], finish_step=False, step=0)
    engine.reduce_bucket(layouts[1], finish_step=True, step=0)
    error = "no error"
    try:
        engine.reduce_bucket(layouts[0], finish_step=False, step=7 if rank == 1 else 1)
        engine.reduce_bucket(layouts[1], finish_step=True, step=1)
    except RuntimeError as exc:
        error = str(exc)
    return {"error": error, "steps": engine.stats["steps"],
            "flat": all(layout.message is not None for layout in layouts)}


def flat_group(rank: int, world: int) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for spec in SPECS:
        for cap_name, cap in CAPS.items():
            for mode, kwargs in MODES.items():
                runs = {flat: train_ddp(rank, spec=spec, steps=3, bucket_cap_mb=cap,
                                        model=chain(5), setup=_flat(flat), hook_kwargs=kwargs)
                        for flat in (True, "device", False)}
                for form in (True, "device"):
                    out[("clean", spec, cap_name, mode, form)] = {
                        "same_params": torch.equal(runs[form]["params"], runs[False]["params"]),
                        "same_stats": runs[form]["stats"] == runs[False]["stats"],
                        "flat": _took_flat_path(runs[form]["state"]),
                        "reference_flat": _took_flat_path(runs[False]["state"]),
                    }
    for spec in SPECS:
        for policy in POLICIES:
            for what, value in INJECTED.items():
                for cap_name in ("one", "several"):
                    runs = {flat: _faulty_run(rank, spec, CAPS[cap_name], policy, value, flat,
                                              overlap=cap_name == "several")
                            for flat in (True, "device", False)}
                    out[("faulty", spec, policy, what, cap_name)] = {
                        flat: run for flat, run in runs.items()
                    }
    for spec in GENERIC_SPECS:
        for policy in ("skip", "zero"):
            out[("faulty-generic", spec, policy)] = {
                flat: _faulty_run(rank, spec, CAPS["several"], policy, INJECTED["nan"], flat,
                                  overlap=True)
                for flat in ("device", False)
            }
    out["desync"] = _out_of_step_on_device(rank)
    out["padded"] = _padded_buffer(rank, transposed=False)
    out["transposed"] = _padded_buffer(rank, transposed=True)
    dist.barrier()
    return out


shared_launch.register(WORLD, "ddp_flat", flat_group, timeout=600, threads=1)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    # Launched with the other modules' workers of this world size (see shared_launch).
    return shared_launch.results(WORLD, "ddp_flat", tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("cap", list(CAPS))
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("form", [True, "device"], ids=["host_form", "device_form"])
def test_the_flat_path_equals_the_ordinary_path(
    results: list[dict[Any, Any]], spec: str, cap: str, mode: str, form: bool | str
) -> None:
    for rank_results in results:
        got = rank_results[("clean", spec, cap, mode, form)]
        assert got == {"same_params": True, "same_stats": True, "flat": True,
                       "reference_flat": False}


@pytest.mark.slow
def test_ranks_out_of_step_are_caught_by_the_device_form(results: list[dict[Any, Any]]) -> None:
    for rank_results in results:
        got = rank_results["desync"]
        assert got["flat"] and got["steps"] == 1, got
        assert got["error"].startswith("ranks are out of step"), got


def _grads_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0))
                                    and torch.equal(x.isnan(), y.isnan()) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("cap", ["one", "several"])
@pytest.mark.parametrize("what", list(INJECTED))
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("spec", SPECS)
def test_a_nonfinite_bucket_on_one_rank_is_handled_as_on_the_ordinary_path(
    results: list[dict[Any, Any]], spec: str, policy: str, what: str, cap: str
) -> None:
    for rank_results in results:
        flat, ordinary = (rank_results[("faulty", spec, policy, what, cap)][k] for k in (True, False))
        assert flat["flat"] and not ordinary["flat"]
        assert _grads_equal(flat["grads"], ordinary["grads"])
        assert flat["stats"] == ordinary["stats"]
        assert torch.equal(flat["params"], ordinary["params"])
        assert flat["errors"] == ordinary["errors"]
        if spec == "bf16" and what == "huge":  # bf16 has fp32's range: the sum stays finite
            assert not flat["errors"] and flat["stats"][-1]["skipped_steps"] == 0
        elif policy == "raise":
            assert len(flat["errors"]) == 1 and len(flat["grads"]) == 1
            reason = "holds NaN or Inf" if what == "nan" else "compression overflowed in average."
            assert reason in flat["errors"][0]
        else:
            assert len(flat["grads"]) == 4 and flat["stats"][-1]["skipped_steps"] == 1
            bad = flat["grads"][1]
            if policy == "skip":  # that bucket and the step's later ones are NaN
                assert bad.isnan().any()
            else:  # the bucket holding the parameter is zeroed, others stand
                assert (bad == 0).any() and not bad.isnan().any()
            assert torch.isfinite(flat["grads"][2]).all()


#: Counters in which the device form may differ from the host path in a non-finite step
#: (as the ordinary device path does, see gradzip.engine.device): a non-finite call's dense
#: bytes are counted, and the later calls of a "skip" step send their payload.
DEVICE_COUNTS = ("payload_bytes", "wire_bytes", "dense_payload_bytes", "dense_wire_bytes",
                 "collective_calls", "compression_rate")


@pytest.mark.slow
@pytest.mark.parametrize("cap", ["one", "several"])
@pytest.mark.parametrize("what", list(INJECTED))
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("spec", SPECS)
def test_a_nonfinite_bucket_in_the_device_form_is_handled_as_on_the_host_path(
    results: list[dict[Any, Any]], spec: str, policy: str, what: str, cap: str
) -> None:
    for rank_results in results:
        device, ordinary = (rank_results[("faulty", spec, policy, what, cap)][k]
                            for k in ("device", False))
        # "raise" needs the host to know at once: the flat path's host form.
        assert device["flat"] and not ordinary["flat"]
        assert _grads_equal(device["grads"], ordinary["grads"])
        assert torch.equal(device["params"], ordinary["params"])
        assert device["errors"] == ordinary["errors"]
        for mine, ref in zip(device["stats"], ordinary["stats"], strict=True):
            differ = DEVICE_COUNTS if policy != "raise" else ()
            assert {k: v for k, v in mine.items() if k not in differ} == \
                {k: v for k, v in ref.items() if k not in differ}


@pytest.mark.slow
def test_views_that_do_not_tile_their_buffer(results: list[dict[Any, Any]]) -> None:
    for rank_results in results:
        for spec, got in rank_results["padded"].items():
            assert got == {"whole": False, "flat": True, "same": True, "gap_untouched": True,
                           "stats": True}, spec


@pytest.mark.slow
def test_views_that_are_not_contiguous_take_the_ordinary_path(
    results: list[dict[Any, Any]],
) -> None:
    for rank_results in results:
        for spec, got in rank_results["transposed"].items():
            assert got == {"whole": False, "flat": False, "same": True, "gap_untouched": True,
                           "stats": True}, spec


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["skip", "zero"])
@pytest.mark.parametrize("spec", GENERIC_SPECS)
def test_a_nonfinite_bucket_decided_on_the_device_by_the_ordinary_path(
    results: list[dict[Any, Any]], spec: str, policy: str
) -> None:
    for rank_results in results:
        device, host = (rank_results[("faulty-generic", spec, policy)][k] for k in ("device", False))
        assert not device["flat"] and not host["flat"]
        assert len(device["grads"]) == len(host["grads"]) == 4
        assert _grads_equal(device["grads"], host["grads"])
        assert device["stats"][-1]["skipped_steps"] == 1  # the step was handled
        assert torch.equal(device["params"], host["params"])
        assert device["errors"] == host["errors"] == []
        for mine, ref in zip(device["stats"], host["stats"], strict=True):
            assert {k: v for k, v in mine.items() if k not in DEVICE_COUNTS} == \
                {k: v for k, v in ref.items() if k not in DEVICE_COUNTS}
