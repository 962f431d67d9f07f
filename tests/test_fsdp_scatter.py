"""gradzip.fsdp.register_reduce_scatter: plain FSDP2 (a 1-D mesh) with its reduce-scatter
compressed through the engine, in real gloo processes of 2 and 4 ranks.

One process-spawning run per world size checks everything (process start-up is most of its
time; the run is shared with other modules' workers of the same size, see ``shared_launch``): ``none`` equals plain FSDP2, and Top-k, PowerSGD and Accordion equal the engine
simulator fed the same unsharded gradients, bit for bit at 2 ranks (a sum of two is the same
arithmetic in any order) and within rounding at 4 (gloo's all-reduce adds in another order
than its reduce-scatter and the simulator); bytes follow the formula, residuals are the
unsharded gradients' size, resume through a DCP checkpoint is bit-identical, a NaN on one rank
is handled by the policy on every rank, and unsupported meshes and models are refused with
one line.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import gradzip
import gradzip.fsdp
import shared_launch
from fsdp_nets import Net, batch, refusal, sharded
from gradzip.comm.base import allreduce_wire_bytes
from gradzip.comm.header import rider_bytes
from gradzip.control import Accordion
from gradzip.fsdp import UnshardedLayout, UnshardedSlot

STEPS = 4
LR = 0.05
SPECS = ["topk:ratio=0.2", "powersgd:rank=2",
         "accordion(steady=topk:ratio=0.05,critical=topk:ratio=0.2,eta=2,interval=1,"
         "per_layer=False,lr_drop=True)"]


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, out: int = 3,
          nan: bool = False) -> dict[str, torch.Tensor]:
    """One training step; returns this rank's gradient shards."""
    x, y = batch(step, rank, out)
    if nan:
        x[:, 0] = float("nan")  # reaches the scale's gradient only (see fsdp_nets.Net)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    if not nan:
        opt.step()
    return grads


def _run(model: nn.Module, rank: int, steps: range, out: int = 3) -> list[dict[str, Any]]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    return [_step(model, opt, s, rank, out) for s in steps]


# -- none against plain FSDP2 -----------------------------------------------------------------
def _none(rank: int, mesh: Any) -> dict[str, Any]:
    native = _run(sharded(mesh), rank, range(STEPS))
    model = sharded(mesh)
    state = gradzip.fsdp.register_reduce_scatter(model, "none", mesh=mesh)
    ours = _run(model, rank, range(STEPS))
    numels = [layout.numel for layout in state.layouts]
    rows = [layout.row_numel for layout in state.layouts]
    return {"native": native, "ours": ours, "stats": state.stats, "numels": numels,
            "rows": rows}


# -- compressors against the simulator --------------------------------------------------------
def _observed(rank: int, mesh: Any, spec: str) -> dict[str, Any]:
    # One output: the last layer has one row, so shards past the first hold only padding.
    model = sharded(mesh, out=1)
    state = gradzip.fsdp.register_reduce_scatter(model, spec, mesh=mesh)
    calls: list[tuple[int, dict[str, torch.Tensor], torch.Tensor]] = []
    exchange = state.exchange

    def observed(layout: UnshardedLayout, input_tensor: torch.Tensor, output: torch.Tensor,
                 op: Any) -> None:
        before = {n: v.clone() for n, v in layout.views(layout.gather(input_tensor)).items()}
        exchange(layout, input_tensor, output, op)
        calls.append((state.layouts.index(layout), before, output.clone()))

    state.exchange = observed  # type: ignore[method-assign]  # the installed path, observed
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    levels = []
    for step in range(STEPS):
        _step(model, opt, step, rank, out=1)
        if isinstance(state.compressor, Accordion):
            levels.append(Accordion.levels(state.engine))
    layouts = [(layout.module, layout.slots, layout.row_numel) for layout in state.layouts]
    return {"calls": calls, "layouts": layouts, "shapes": dict(state.shapes),
            "stats": state.stats, "residual_bytes": state.residual_bytes(), "levels": levels,
            "shard_bytes": sum(p.to_local().numel() * 4 for p in model.parameters())}


def _check_against_simulator(ranks: list[dict[str, Any]], spec: str) -> None:
    world = len(ranks)
    engine = gradzip.Engine(ranks[0]["shapes"], spec, collective=gradzip.SimulatedGroup(world))
    layouts = [UnshardedLayout(module, None, None, slots, world, rows)
               for module, slots, rows in ranks[0]["layouts"]]
    calls = len(ranks[0]["calls"])
    assert calls == STEPS * len(layouts)
    for at in range(calls):
        index = ranks[0]["calls"][at][0]
        assert all(r["calls"][at][0] == index for r in ranks)
        stacked = {n: torch.stack([r["calls"][at][1][n] for r in ranks])
                   for n in ranks[0]["calls"][at][1]}
        # The last call of a backward (FSDP2 reduces in backward order: the root last)
        # finishes the step.
        last = at % len(layouts) == len(layouts) - 1
        out = engine.reduce(stacked, finish_step=last, same_layout=True)
        layout = layouts[index]
        flat = torch.cat([out[s.name].reshape(-1) for s in layout.slots])
        for shard, member in enumerate(ranks):
            want = torch.full((layout.row_numel,), -1.0)
            layout.scatter(flat, want, shard)
            got = member["calls"][at][2]
            if world == 2:  # two summands: the order of addition cannot matter
                assert torch.equal(got, want), (spec, at, shard)
            else:  # gloo's all-reduce adds in another order than the simulator
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if spec.startswith("accordion"):  # the run switches level: its decisions are exercised
        assert {level for step in ranks[0]["levels"] for level in step.values()} == {
            "steady", "critical"}
        assert all(r["levels"] == ranks[0]["levels"] for r in ranks)
    for j, member in enumerate(ranks):
        for key in ("payload_bytes", "wire_bytes", "dense_payload_bytes", "dense_wire_bytes",
                    "steps", "collective_calls"):
            want = engine.stats[key]
            assert member["stats"][key] == (want[j] if isinstance(want, list) else want), key
        # Residuals: the unsharded gradients', on every rank (Top-k keeps one per tensor).
        numel = sum(shape.numel() for shape in member["shapes"].values())
        if spec.startswith("topk"):
            assert member["residual_bytes"] == 4 * numel
            assert member["shard_bytes"] < member["residual_bytes"]


# -- resume through a torch.distributed.checkpoint folder -------------------------------------
def _resume(rank: int, mesh: Any, folder: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    spec = "powersgd:rank=2"
    straight = sharded(mesh)
    gradzip.fsdp.register_reduce_scatter(straight, spec, mesh=mesh)
    expected = _run(straight, rank, range(STEPS))[STEPS // 2:]
    first = sharded(mesh)
    state = gradzip.fsdp.register_reduce_scatter(first, spec, mesh=mesh)
    _run(first, rank, range(STEPS // 2))
    saved = state.state_dict()
    dcp.save({"model": first.state_dict(), "gradzip": gradzip.fsdp.DCPEntry(state)},
             checkpoint_id=folder)
    resumed = sharded(mesh)
    with torch.no_grad():
        for p in resumed.parameters():
            p.to_local().zero_()  # nothing carried over but the checkpoint
    state = gradzip.fsdp.register_reduce_scatter(resumed, spec, mesh=mesh)
    loaded = {"model": resumed.state_dict(), "gradzip": gradzip.fsdp.DCPEntry(state)}
    dcp.load(loaded, checkpoint_id=folder)
    resumed.load_state_dict(loaded["model"])
    bytes_kept = state.stats["reduce_scatter_wire_bytes"] == saved["reduce_scatter_wire_bytes"]
    got = _run(resumed, rank, range(STEPS // 2, STEPS))
    params_equal = all(torch.equal(a.to_local(), b.to_local())
                       for a, b in zip(straight.parameters(), resumed.parameters(), strict=True))
    return {"expected": expected, "got": got, "params_equal": params_equal,
            "steps": state.stats["steps"], "bytes_kept": bytes_kept}


# -- a NaN on one rank -------------------------------------------------------------------------
def _nan(rank: int, mesh: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = sharded(mesh)
    state = gradzip.fsdp.register_reduce_scatter(model, "topk:ratio=0.2", mesh=mesh,
                                                 nonfinite="skip")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    _step(model, opt, 0, rank)
    # Only rank 0's input holds a NaN: only rank 0's unsharded gradient of the scale has it.
    grads = _step(model, opt, 1, rank, nan=rank == 0)
    out["skip_scale_nan"] = bool(grads["scale"].isnan().all())
    out["skipped"] = state.stats["skipped_steps"]
    after = _step(model, opt, 2, rank)
    out["then_finite"] = all(bool(g.isfinite().all()) for g in after.values())
    out["steps"] = state.stats["steps"]
    model = sharded(mesh)
    gradzip.fsdp.register_reduce_scatter(model, "topk:ratio=0.2", mesh=mesh, nonfinite="raise")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    try:
        _step(model, opt, 1, rank, nan=rank == 0)
        out["raised"] = None
    except FloatingPointError as exc:
        out["raised"] = str(exc)
    dist.barrier()
    return out


# -- what is refused ---------------------------------------------------------------------------
def _errors(rank: int, mesh: Any, world: int) -> list[str]:
    from torch.distributed.fsdp import fully_shard

    messages = []

    def refused(fn: Any, *args: Any, **kwargs: Any) -> None:
        messages.append(refusal(fn, *args, **kwargs))

    register = gradzip.fsdp.register_reduce_scatter
    square = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    model = sharded(mesh)
    refused(register, Net(3), "none", mesh=mesh)  # not fully_shard-ed
    refused(register, model, "none", mesh=square)  # a 2-D mesh: HSDP's entry point
    refused(register, model, "none", mesh="mesh")
    refused(register, sharded(square), "none", mesh=mesh)  # native HSDP on the 2-D mesh
    divided = sharded(mesh)
    divided.set_gradient_divide_factor(float(world))
    refused(register, divided, "none", mesh=mesh)
    frozen = nn.Linear(4, 4).requires_grad_(False)
    fully_shard(frozen, mesh=mesh)
    refused(register, frozen, "none", mesh=mesh)
    state = register(model, "none", mesh=mesh)
    refused(register, model, "none", mesh=mesh)  # twice
    refused(state.load_state_dict, {"format": "gradzip.fsdp.reduce_scatter/1", "shards": 3,
                                    "shard_rank": rank, "engine": {},
                                    "reduce_scatter_wire_bytes": 0})
    state.remove()
    register(model, "none", mesh=mesh)  # allowed again once removed
    return messages


def _worker(rank: int, world: int, folder: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    out = {"none": _none(rank, mesh)}
    # At 4 ranks Top-k alone: the same code path as PowerSGD, at twice the start-up cost.
    specs = SPECS if world == 2 else SPECS[:1]
    out.update({spec: _observed(rank, mesh, spec) for spec in specs})
    if world == 2:  # the rest does not depend on the world size
        out.update(resume=_resume(rank, mesh, folder), nan=_nan(rank, mesh),
                   errors=_errors(rank, mesh, world))
    return out


for _world in (2, 4):
    shared_launch.register(_world, "fsdp_scatter", _worker, with_folder=True, timeout=400)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_compressed_reduce_scatter_of_plain_fsdp2(
        world: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    # Launched with the other modules' workers of this world size (see shared_launch).
    ranks = shared_launch.results(world, "fsdp_scatter", tmp_path_factory)
    header = rider_bytes(torch.float32, world, summed=True)
    for out in ranks:
        none = out["none"]
        for native, ours in zip(none["native"], none["ours"], strict=True):
            for name in native:
                if world == 2:
                    assert torch.equal(native[name], ours[name]), name
                else:
                    torch.testing.assert_close(ours[name], native[name], rtol=0, atol=1e-7)
        # Bytes: one dense all-reduce of each group's unsharded gradient, the header riding
        # in it; FSDP2's own reduce-scatter would send (W - 1) rows of the padded layout.
        stats = none["stats"]
        assert stats["steps"] == STEPS
        assert stats["payload_bytes"] == STEPS * sum(4 * n + header for n in none["numels"])
        assert stats["wire_bytes"] == STEPS * sum(
            allreduce_wire_bytes(4 * n + header, world) for n in none["numels"])
        assert stats["reduce_scatter_wire_bytes"] == STEPS * sum(
            (world - 1) * 4 * r for r in none["rows"])
        assert stats["compression_rate"] == stats["reduce_scatter_wire_bytes"] / stats[
            "wire_bytes"]
    for spec in SPECS if world == 2 else SPECS[:1]:
        _check_against_simulator([out[spec] for out in ranks], spec)
    if world != 2:
        return
    for rank, out in enumerate(ranks):
        resume = out["resume"]
        assert resume["steps"] == STEPS and resume["params_equal"] and resume["bytes_kept"]
        for want, got in zip(resume["expected"], resume["got"], strict=True):
            for name in want:
                assert torch.equal(want[name], got[name]), name
        assert out["nan"]["skipped"] == 1, rank
        assert out["nan"]["skip_scale_nan"], rank
        assert out["nan"]["then_finite"], rank
        assert out["nan"]["steps"] == 3, rank
        assert out["nan"]["raised"], rank
    messages, others = (out["errors"] for out in ranks)
    assert others == messages  # every rank refuses alike
    expected = [
        "TypeError: `model` must be fully_shard-ed",
        "ValueError: `mesh` must be 1-D (every rank a shard), got a 2-D mesh",
        "TypeError: `mesh` must be a torch.distributed.device_mesh.DeviceMesh, got str",
        "ValueError: FSDP module '<root>' is sharded on a 2-D mesh",
        "ValueError: FSDP module '<root>' has a gradient divide factor",
        "ValueError: `model` must have a trainable parameter",
        "ValueError: FSDP module '<root>' already has a custom reduce-scatter",
        "ValueError: `state['shards']` must be 2",
    ]
    assert len(messages) == len(expected), messages
    for message, start in zip(messages, expected, strict=True):
        assert message.startswith(start), message
        assert "\n" not in message


# -- the layout, without processes -------------------------------------------------------------
def test_the_unsharded_layout_gathers_fsdp2_rows_and_scatters_this_ranks_row() -> None:
    # Two shards. A 3 x 2 weight: 2 rows per slot (the second slot's last row is padding);
    # a 1-element bias: 1 per slot (the second slot all padding).
    slots = (UnshardedSlot("w", torch.Size((3, 2)), 2, 0), UnshardedSlot("b", torch.Size((1,)), 1, 4))
    layout = UnshardedLayout("block", None, None, slots, 2, 5)
    w, b = torch.arange(1.0, 7.0).view(3, 2), torch.tensor([7.0])
    # FSDP2's input: row r = rows [2r, 2r + 2) of w (zero padded), then row r of b (padded).
    rows = torch.tensor([[1.0, 2, 3, 4, 7], [5, 6, 0, 0, 0]])
    flat = layout.gather(rows.view(-1))
    assert torch.equal(flat, torch.cat([w.view(-1), b]))
    views = layout.views(flat)
    assert torch.equal(views["w"], w) and torch.equal(views["b"], b)
    for shard in range(2):
        out = torch.full((5,), -1.0)
        layout.scatter(flat, out, shard)
        assert torch.equal(out, rows[shard])  # padding zeroed
    assert layout.numel == 7
    with pytest.raises(ValueError, match=r"input of FSDP module 'block' must be a 1-D tensor of 10"):
        layout.gather(torch.zeros(9))
    with pytest.raises(ValueError, match=r"output of FSDP module 'block' must be a 1-D tensor of 5"):
        layout.scatter(flat, torch.zeros(6), 0)
