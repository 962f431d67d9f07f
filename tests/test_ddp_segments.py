"""The segment path (a whole-message compressor with error feedback behind the DDP hook, its
call kept as one flat row) against the ordinary engine path, in real gloo groups.

The ordinary host path (``decide_on="host"``) is the reference, and the ordinary device path
(the segment path switched off) a second one: the segment path must give the same gradients,
parameters, counters, compression errors and checkpoints bit for bit, per bucket and fused,
with one and several buckets, with a NaN in one rank's bucket under ``"skip"`` and
``"zero"``, and across a resume. Three processes, so that the all-gather's rows come from
more than one other rank.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip.ddp
import gradzip.engine.core
import shared_launch
from ddp_helpers import ONE_BUCKET_MB, TINY_BUCKET_MB, batch, chain, flat_params

WORLD = 3
#: Compressors with a segment form. Top-k 20% keeps a tensor of 4 entries or fewer dense
#: (cheaper than its sparse message at W=3): the row then holds both kinds; 50% sends most
#: small tensors dense; Rand-k and QSGD draw their noise from the tensors' names; QSGD keeps
#: no residual (unbiased: no error feedback by default), the same with one (pinned to the
#: all-gather: at three workers it shards most of these tensors); the hard threshold with a
#: capacity keeps counters in its state; with ``dense_1d`` the engine sends the biases dense
#: itself, beside the compressor's row; PowerSGD sends its own dense tensors first in the row
#: and reads its groups of matrices from it; Accordion with PowerSGD at both levels lays the
#: row out by the tensors' levels, a new plan after each decision that changes one.
ACCORDION = "accordion(steady=powersgd:rank=1,critical=powersgd:rank=2,eta=0.5,interval=2)"
SPECS = ("topk:ratio=0.2", "topk:ratio=0.5", "sign", "randk:ratio=0.2", "qsgd:exchange=allgather",
         "qsgd:exchange=allgather+feedback", "threshold:lam=0.05,capacity=0.2",
         "topk:ratio=0.2+dense_1d", "powersgd:rank=2", ACCORDION,
         "accordion(steady=powersgd:rank=2,critical=none,eta=0.5,interval=2)")
#: One of each segment form, for the non-finite scenarios.
NAN_SPECS = ("topk:ratio=0.2", "sign", "randk:ratio=0.2", "qsgd:exchange=allgather",
             "threshold:lam=0.05,capacity=0.2", "topk:ratio=0.2+dense_1d", "powersgd:rank=2",
             ACCORDION)
CAPS = {"one": ONE_BUCKET_MB, "several": TINY_BUCKET_MB}


def _layouts(state: Any) -> list[Any]:
    fused = state._fused._fused if state._fused is not None else None
    if fused is not None:
        return [fused[2]]
    return [layout for _, layout in state._layouts.values()]


def _segmented(state: Any) -> bool:
    """Whether every bucket went the segment path (but those whose tensors the engine sends
    dense, which have nothing to compress)."""
    dense = state.engine.dense_names
    layouts = [layout for layout in _layouts(state) if set(layout.names) - dense]
    return bool(layouts) and all(
        layout.segments is not None and layout.segments.calls > 0 for layout in layouts)


def _run(rank: int, spec: str, *, path: str, cap: float, fuse: bool = False,
         policy: str = "skip", nan_at: int | None = None, steps: int = 4,
         load: dict[str, Any] | None = None, start: int = 0) -> dict[str, Any]:
    """``steps`` steps on ``path``: ``"segments"`` (the device path, which takes the segment
    path where it applies), ``"device"`` (the ordinary device path) or ``"host"``; at step
    ``nan_at`` rank 1's gradient of one parameter is NaN."""
    torch.manual_seed(0)
    model = chain(5)
    ddp = DDP(model, bucket_cap_mb=cap)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # "+feedback": error feedback switched on; "+dense_1d": 1-D tensors sent dense by the engine.
    spec, *flags = spec.split("+")
    state = gradzip.ddp.register(ddp, spec, optimizer=opt, nonfinite=policy,
                                 fuse_buckets=fuse, overlap=not fuse,
                                 error_feedback=True if "feedback" in flags else None,
                                 dense_1d="dense_1d" in flags)
    state.engine.decide_on = "host" if path == "host" else "device"
    if load is not None:
        model.load_state_dict(load["model"])
        opt.load_state_dict(load["opt"])
        state.load_state_dict(load["hook"])
    original = gradzip.engine.core.segments_apply
    if path == "device":
        gradzip.engine.core.segments_apply = lambda *args: False
    target = list(model.parameters())[1]
    grads, stats, errors = [], [], []
    try:
        for step in range(start, start + steps):
            handle = None
            if step == nan_at and rank == 1:
                handle = target.register_hook(lambda g: torch.full_like(g, math.nan))
            opt.zero_grad()
            x, y = batch(step, rank)
            try:
                nn.functional.mse_loss(ddp(x), y).backward()
            finally:
                if handle is not None:
                    handle.remove()
            grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            grads.append(grad)
            stats.append(state.stats)
            errors.append(state.engine.compression_error())
            if torch.isfinite(grad).all():
                opt.step()
    finally:
        gradzip.engine.core.segments_apply = original
    return {"grads": torch.stack(grads), "stats": stats, "errors": errors,
            "params": flat_params(model), "segmented": _segmented(state),
            "saved": {"model": model.state_dict(), "opt": opt.state_dict(),
                      "hook": state.state_dict()}}


#: Counters in which a device decision differs from a host one by design: after a non-finite
#: call the host path sends the next calls' headers only, the device path their payloads.
DEVICE_COUNTS = ("payload_bytes", "wire_bytes", "dense_payload_bytes", "dense_wire_bytes",
                 "collective_calls", "compression_rate")


def _same(a: dict[str, Any], b: dict[str, Any], apart: tuple[str, ...] = ()) -> dict[str, bool]:
    def kept(stats: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in s.items() if k not in apart} for s in stats]

    return {
        "grads": torch.equal(a["grads"].nan_to_num(7.0), b["grads"].nan_to_num(7.0)),
        "params": torch.equal(a["params"], b["params"]),
        "stats": kept(a["stats"]) == kept(b["stats"]),
        "errors": a["errors"] == b["errors"],
    }


def _same_residuals(a: dict[str, Any], b: dict[str, Any]) -> bool:
    mine, theirs = a["saved"]["hook"]["residuals"], b["saved"]["hook"]["residuals"]
    return mine.keys() == theirs.keys() and all(torch.equal(mine[n], theirs[n]) for n in mine)


def segments_group(rank: int, world: int) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for spec in SPECS:
        for cap_name, cap in CAPS.items():
            for fuse in (False, True):
                runs = {path: _run(rank, spec, path=path, cap=cap, fuse=fuse)
                        for path in ("segments", "device", "host")}
                out[("clean", spec, cap_name, fuse)] = {
                    "taken": runs["segments"]["segmented"],
                    "reference_taken": runs["device"]["segmented"] or runs["host"]["segmented"],
                    "vs_host": _same(runs["segments"], runs["host"]),
                    "vs_device": _same(runs["segments"], runs["device"]),
                    "residuals": _same_residuals(runs["segments"], runs["host"]),
                    "kept": len(runs["segments"]["saved"]["hook"]["residuals"]),
                }
    for spec, policy, fuse in itertools.product(NAN_SPECS, ("skip", "zero"),
                                                (False, True)):
        runs = {path: _run(rank, spec, path=path, cap=TINY_BUCKET_MB, fuse=fuse,
                           policy=policy, nan_at=2)
                for path in ("segments", "device", "host")}
        out[("nan", spec, policy, fuse)] = {
            "taken": runs["segments"]["segmented"],
            "vs_device": _same(runs["segments"], runs["device"]),
            "vs_host": _same(runs["segments"], runs["host"], apart=DEVICE_COUNTS),
            "device_vs_host_errors": runs["device"]["errors"] == runs["host"]["errors"],
            "skipped": runs["segments"]["stats"][-1]["skipped_steps"],
            "nan_step": bool(runs["segments"]["grads"][2].isnan().any()),
        }
    # Resume: two steps, a checkpoint, two more in a fresh model and hook.
    whole = _run(rank, SPECS[0], path="segments", cap=TINY_BUCKET_MB, steps=4)
    first = _run(rank, SPECS[0], path="segments", cap=TINY_BUCKET_MB, steps=2)
    second = _run(rank, SPECS[0], path="segments", cap=TINY_BUCKET_MB, steps=2,
                  load=first["saved"], start=2)
    out["resume"] = {"params": torch.equal(whole["params"], second["params"]),
                     "grads": torch.equal(whole["grads"][2:], second["grads"]),
                     "taken": second["segmented"]}
    # The sharded exchange (pinned) has no segment form: the ordinary call, the same bits.
    sharded = "topk:ratio=0.2,exchange=sharded"
    runs = {path: _run(rank, sharded, path=path, cap=ONE_BUCKET_MB)
            for path in ("segments", "host")}
    out["sharded"] = {"taken": runs["segments"]["segmented"],
                      "vs_host": _same(runs["segments"], runs["host"])}
    dist.barrier()
    return out


shared_launch.register(WORLD, "ddp_segments", segments_group, timeout=600, threads=1)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    return shared_launch.results(WORLD, "ddp_segments", tmp_path_factory)


ALL_SAME = {"grads": True, "params": True, "stats": True, "errors": True}


@pytest.mark.slow
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("cap_name", list(CAPS))
@pytest.mark.parametrize("spec", SPECS)
def test_the_segment_path_equals_the_ordinary_paths(
    results: list[dict[Any, Any]], spec: str, cap_name: str, fuse: bool
) -> None:
    for rank_results in results:
        got = rank_results[("clean", spec, cap_name, fuse)]
        assert got["taken"] and not got["reference_taken"]
        assert got["vs_host"] == ALL_SAME
        assert got["vs_device"] == ALL_SAME
        assert got["residuals"]
        assert (got["kept"] > 0) == (spec != "qsgd:exchange=allgather")  # unbiased: none kept


@pytest.mark.slow
@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("policy", ["skip", "zero"])
@pytest.mark.parametrize("spec", NAN_SPECS)
def test_a_nan_on_one_rank_is_handled_as_on_the_host_path(
    results: list[dict[Any, Any]], spec: str, policy: str, fuse: bool
) -> None:
    for rank_results in results:
        got = rank_results[("nan", spec, policy, fuse)]
        assert got["taken"]
        assert got["vs_device"] == ALL_SAME
        # The compression errors as the ordinary device path counts them (which may differ
        # from the host path's in a handled step), the rest as the host path's.
        assert got["vs_host"] == {**ALL_SAME, "errors": got["device_vs_host_errors"]}
        assert got["skipped"] == 1
        assert got["nan_step"] == (policy == "skip")


@pytest.mark.slow
def test_a_resumed_run_continues_bit_for_bit(results: list[dict[Any, Any]]) -> None:
    for rank_results in results:
        assert rank_results["resume"] == {"params": True, "grads": True, "taken": True}


@pytest.mark.slow
def test_the_sharded_exchange_takes_the_ordinary_call(results: list[dict[Any, Any]]) -> None:
    for rank_results in results:
        assert rank_results["sharded"] == {"taken": False, "vs_host": ALL_SAME}
