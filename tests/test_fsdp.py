"""gradzip.fsdp: HSDP (FSDP2 on a replicate x shard mesh) with a compressed exchange across
replicas, in real gloo processes of 2 (1 x 2) and 4 (2 x 2) ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import gradzip
import gradzip.fsdp
import shared_launch
from ddp_helpers import spawn
from fsdp_nets import Net, refusal
from fsdp_nets import batch as _batch
from fsdp_nets import sharded as _sharded
from gradzip.comm import run_processes

STEPS = 4
LR = 0.05
MESHES = [(1, 2), (2, 2)]
SPECS = ["powersgd:rank=2", "topk:ratio=0.2"]


def _mesh(world: int, replicas: int) -> Any:
    return init_device_mesh("cpu", (replicas, world // replicas),
                            mesh_dim_names=("replicate", "shard"))


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int,
          nan: bool = False) -> dict[str, torch.Tensor]:
    """One training step; returns this rank's local gradient shards."""
    x, y = _batch(step, rank, model.fc3.out_features)
    if nan:
        x[:, 0] = float("nan")
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
    if not nan:
        opt.step()
    return grads


# -- none equals native HSDP ------------------------------------------------------------------
def _native_worker(rank: int, world: int, replicas: int) -> dict[str, Any]:
    mesh = _mesh(world, replicas)
    runs = {}
    for kind in ("native", "gradzip"):
        model = _sharded(mesh if kind == "native" else mesh["shard"])
        if kind == "gradzip":
            gradzip.fsdp.register(model, "none", mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        grads = [_step(model, opt, s, rank) for s in range(STEPS)]
        # Two micro-batches, the first without the cross-replica all-reduce.
        opt.zero_grad()
        for micro in range(2):
            model.set_requires_all_reduce(micro == 1)
            x, y = _batch(100 + micro, rank)
            nn.functional.mse_loss(model(x), y).backward()
        grads.append({n: p.grad.to_local().clone() for n, p in model.named_parameters()})
        runs[kind] = grads
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("replicas,shards", MESHES)
def test_none_is_bit_identical_to_native_hsdp(mesh_runs: Any, replicas: int, shards: int) -> None:
    for runs in (r["native"] for r in mesh_runs(replicas)):
        for native, ours in zip(runs["native"], runs["gradzip"], strict=True):
            assert native.keys() == ours.keys()
            for name in native:
                assert torch.equal(native[name], ours[name]), name


# -- the engine simulator, fed the same shards ------------------------------------------------
def _parity_worker(rank: int, world: int, replicas: int, spec: str) -> dict[str, Any]:
    mesh = _mesh(world, replicas)
    # One output: the last layer's weight and bias have one row, so the second shard of that
    # group is empty (its hook call has nothing to exchange, its flag still takes part).
    model = _sharded(mesh["shard"], out=1)
    state = gradzip.fsdp.register(model, spec, mesh=mesh)
    calls: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
    for layout in state.groups:
        def hook(flat: torch.Tensor, layout: gradzip.fsdp.GroupLayout = layout) -> None:
            before = {n: v.clone() for n, v in layout.views(flat).items()}
            state.exchange(layout, flat)
            calls.append((before, {n: v.clone() for n, v in layout.views(flat).items()}))
        layout.owner.set_all_reduce_hook(hook)  # the registered hook, observed
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for s in range(STEPS):
        _step(model, opt, s, rank)
    return {"calls": calls, "shapes": dict(state.shapes), "groups": len(state.groups),
            "shard_rank": state.shard_rank, "replica_rank": state.replica_rank,
            "stats": state.stats}


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("replicas,shards", MESHES)
def test_results_equal_the_simulator_fed_the_same_shards(mesh_runs: Any, replicas: int,
                                                         shards: int, spec: str) -> None:
    ranks = [r["parity"][spec] for r in mesh_runs(replicas)]
    groups = ranks[0]["groups"]
    for shard in range(shards):
        # The replica group of this shard index, in replica order.
        members = sorted((r for r in ranks if r["shard_rank"] == shard),
                         key=lambda r: r["replica_rank"])
        assert len(members) == replicas
        engine = gradzip.Engine(members[0]["shapes"], spec,
                                collective=gradzip.SimulatedGroup(replicas))
        assert len(members[0]["calls"]) == STEPS * groups
        for step in range(STEPS):
            calls = members[0]["calls"][step * groups:(step + 1) * groups]
            last = max(k for k, call in enumerate(calls) if call[0])
            for k in range(groups):
                at = step * groups + k
                if not calls[k][0]:  # this shard index holds nothing of the group
                    assert shards > 1 and all(not m["calls"][at][1] for m in members)
                    continue
                before = {n: torch.stack([m["calls"][at][0][n] for m in members])
                          for n in members[0]["calls"][at][0]}
                # same_layout: the header rides in the payload, as in the hook's calls.
                out = engine.reduce(before, finish_step=k == last, same_layout=True)
                for j, member in enumerate(members):
                    for name, value in member["calls"][at][1].items():
                        assert torch.equal(out[name], value), (step, name, j)  # one average
        # The bytes across the replica dimension, as the simulator counts them.
        for j, member in enumerate(members):
            for key in ("payload_bytes", "wire_bytes", "dense_payload_bytes", "steps"):
                want = engine.stats[key]
                assert member["stats"][key] == (want[j] if isinstance(want, list) else want), key


# -- residual memory -------------------------------------------------------------------------
def _memory_worker(rank: int, world: int, replicas: int) -> dict[str, int]:
    mesh = _mesh(world, replicas)
    model = _sharded(mesh["shard"], out=4)
    state = gradzip.fsdp.register(model, "topk:ratio=0.2", mesh=mesh)
    x, y = _batch(0, rank, out=4)
    nn.functional.mse_loss(model(x), y).backward()
    # The DDP path on the same model, unsharded, over every rank.
    ddp = nn.parallel.DistributedDataParallel(Net(4))
    hook = gradzip.ddp.register(ddp, "topk:ratio=0.2", overlap=False)
    nn.functional.mse_loss(ddp(x), y).backward()
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    return {"fsdp": state.residual_bytes(), "ddp": sum(
        r.numel() * r.element_size() for r in hook.engine.residuals.values()), "shard": shard}


@pytest.mark.slow
@pytest.mark.parametrize("replicas,shards", MESHES)
def test_residuals_are_a_shard_not_a_model(mesh_runs: Any, replicas: int, shards: int) -> None:
    for measured in (r["memory"] for r in mesh_runs(replicas)):
        assert measured["ddp"] > 0
        assert measured["fsdp"] * shards == measured["ddp"]  # every dimension divides evenly
        assert measured["fsdp"] == measured["shard"]


# -- resume, through a torch.distributed.checkpoint folder ------------------------------------
def _resume_worker(rank: int, world: int, folder: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    mesh = _mesh(world, 2)
    spec = "powersgd:rank=2"

    def run(model: Net, state: Any, steps: range) -> list[dict[str, torch.Tensor]]:
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        return [_step(model, opt, s, rank) for s in steps]

    straight = _sharded(mesh["shard"])
    expected = run(straight, gradzip.fsdp.register(straight, spec, mesh=mesh), range(STEPS))
    first = _sharded(mesh["shard"])
    state = gradzip.fsdp.register(first, spec, mesh=mesh)
    run(first, state, range(STEPS // 2))
    # The compression state inside the DCP checkpoint, and as a file per rank beside it.
    dcp.save({"model": first.state_dict(), "gradzip": gradzip.fsdp.DCPEntry(state)}, checkpoint_id=folder)
    state.save(folder)
    resumed = _sharded(mesh["shard"])
    with torch.no_grad():
        for p in resumed.parameters():
            p.to_local().zero_()  # nothing carried over but the checkpoint
    state = gradzip.fsdp.register(resumed, spec, mesh=mesh)
    loaded = {"model": resumed.state_dict(), "gradzip": gradzip.fsdp.DCPEntry(state)}
    dcp.load(loaded, checkpoint_id=folder)
    resumed.load_state_dict(loaded["model"])
    from_file = gradzip.fsdp.register(_sharded(mesh["shard"]), spec, mesh=mesh)
    from_file.load(folder)
    same_state = _same_tree(from_file.state_dict(), state.state_dict())
    got = run(resumed, state, range(STEPS // 2, STEPS))
    params_equal = all(torch.equal(a.to_local(), b.to_local())
                       for a, b in zip(straight.parameters(), resumed.parameters(), strict=True))
    return {"expected": expected[STEPS // 2:], "got": got, "params_equal": params_equal,
            "steps": state.stats["steps"], "same_state": same_state}


def _same_tree(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _same_tree(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(
            _same_tree(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.slow
def test_resume_mid_run_is_bit_identical(mesh_runs: Any) -> None:
    ranks = mesh_runs(2)
    folder = Path(mesh_runs.folders[2])
    for out in (r["resume"] for r in ranks):
        assert out["steps"] == STEPS
        assert out["params_equal"]
        assert out["same_state"]  # the DCP entry and the file per rank hold the same state
        for want, got in zip(out["expected"], out["got"], strict=True):
            for name in want:
                assert torch.equal(want[name], got[name]), name
    assert len(list(folder.glob("gradzip-fsdp-rank*.pt"))) == 4


# -- a NaN on one rank -----------------------------------------------------------------------
def _nan_worker(rank: int, world: int) -> dict[str, Any]:
    mesh = _mesh(world, 2)
    out: dict[str, Any] = {}
    model = _sharded(mesh["shard"])
    state = gradzip.fsdp.register(model, "topk:ratio=0.2", mesh=mesh, nonfinite="skip")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    _step(model, opt, 0, rank)
    # Only rank 0's input holds a NaN: it reaches the scale's gradient entry 0, in shard 0.
    grads = _step(model, opt, 1, rank, nan=rank == 0)
    out["skip_scale_nan"] = bool(grads["scale"].isnan().all())
    out["skip_skipped"] = state.stats["skipped_steps"]
    after = _step(model, opt, 2, rank)
    out["skip_then_finite"] = all(bool(g.isfinite().all()) for g in after.values())
    out["skip_steps"] = state.stats["steps"]

    model = _sharded(mesh["shard"])
    gradzip.fsdp.register(model, "topk:ratio=0.2", mesh=mesh, nonfinite="raise")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    try:
        _step(model, opt, 1, rank, nan=rank == 0)
        out["raised"] = None
    except FloatingPointError as exc:
        out["raised"] = str(exc)
    dist.barrier()
    return out


@pytest.mark.slow
def test_a_nan_on_one_rank_is_handled_by_the_policy_on_every_rank(mesh_runs: Any) -> None:
    for rank, out in enumerate(r["nan"] for r in mesh_runs(2)):
        assert out["skip_skipped"] == 1, rank
        assert out["skip_scale_nan"], rank
        assert out["skip_then_finite"], rank
        assert out["skip_steps"] == 3, rank
        assert out["raised"], rank


# -- a replica out of step by its optimizer steps --------------------------------------------
def _drift_worker(rank: int, world: int) -> str | None:
    mesh = _mesh(world, 2)  # 2 x 1: two replicas of an unsharded model
    model = _sharded(mesh["shard"])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    gradzip.fsdp.register(model, "topk:ratio=0.2", mesh=mesh, optimizer=opt)

    def backward(step: int) -> None:
        x, y = _batch(step, rank)
        nn.functional.mse_loss(model(x), y).backward()

    try:
        # As many backward passes on both replicas, but rank 0 steps its optimizer after two
        # of them and rank 1 after each: at the second, their optimizer steps differ.
        backward(0)
        if rank == 1:
            opt.step()
        backward(1)
        opt.step()
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.slow
def test_a_replica_whose_optimizer_steps_differ_fails_on_every_rank() -> None:
    for message in run_processes(_drift_worker, 2, timeout=240):
        assert message is not None and message.startswith("ranks are out of step"), message


# -- what is refused -------------------------------------------------------------------------
def _errors_worker(rank: int, world: int) -> list[str]:
    mesh = _mesh(world, 1)
    messages = []

    def refused(fn: Any, *args: Any, **kwargs: Any) -> None:
        messages.append(refusal(fn, *args, **kwargs))

    register = gradzip.fsdp.register
    refused(register, Net(3), "none", mesh=mesh)  # not fully_shard-ed
    model = _sharded(mesh["shard"])
    refused(register, model, "none", mesh=mesh["shard"])  # 1-D mesh
    refused(register, model, "none", mesh="mesh")
    flat = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "fsdp"))
    refused(register, model, "none", mesh=flat)  # names
    refused(register, _sharded(mesh), "none", mesh=mesh)  # native HSDP
    refused(register, model, "none", mesh=mesh, replicate_dim="shard")
    narrow = nn.Linear(4, 1)  # one row: the second shard holds nothing
    fully_shard(narrow, mesh=mesh["shard"])
    refused(register, narrow, "none", mesh=mesh)
    state = register(model, "none", mesh=mesh)
    refused(register, model, "none", mesh=mesh)  # twice
    refused(state.load_state_dict, {"format": "gradzip.fsdp/1", "replicas": 1, "shards": 3,
                                    "shard_rank": 0, "engine": {}})
    state.remove()
    register(model, "none", mesh=mesh)  # allowed again once removed
    return messages


@pytest.mark.slow
def test_unsupported_models_and_meshes_are_refused_with_one_line(mesh_runs: Any) -> None:
    messages, others = (r["errors"] for r in mesh_runs(1))
    assert others == messages  # every rank refuses alike
    expected = [
        "TypeError: `model` must be fully_shard-ed",
        "ValueError: `mesh` must be 2-D (replicate x shard), got a 1-D mesh",
        "TypeError: `mesh` must be a torch.distributed.device_mesh.DeviceMesh, got str",
        "ValueError: `mesh` must name its dimensions 'replicate' and 'shard'",
        "ValueError: FSDP module '<root>' is sharded on a 2-D mesh",
        "ValueError: `replicate_dim` and `shard_dim` must differ",
        "ValueError: `model` must give every one of the 2 shards a non-empty part",
        "ValueError: FSDP module '<root>' already has an all-reduce hook",
        "ValueError: `state['shards']` must be 2",
    ]
    assert len(messages) == len(expected)
    for message, start in zip(messages, expected, strict=True):
        assert message.startswith(start), message
        assert "\n" not in message


# -- one launch per mesh ------------------------------------------------------------------------
def _mesh_worker(rank: int, world: int, replicas: int, folder: str) -> dict[str, Any]:
    """Every scenario above that runs on this mesh, in one set of processes (starting gloo
    processes costs more than most scenarios; each scenario builds its own models and meshes,
    in the same order on every rank)."""
    out: dict[str, Any] = {"native": _native_worker(rank, world, replicas),
                           "parity": {s: _parity_worker(rank, world, replicas, s) for s in SPECS},
                           "memory": _memory_worker(rank, world, replicas)}
    if replicas == 1:
        out["errors"] = _errors_worker(rank, world)
    else:
        out["resume"] = _resume_worker(rank, world, folder)
        out["nan"] = _nan_worker(rank, world)
    return out


for _replicas in (1, 2):
    shared_launch.register(_replicas * 2, "fsdp", _mesh_worker, _replicas, with_folder=True,
                           timeout=480)


@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``mesh_runs(replicas)``: every rank's :func:`_mesh_worker` results on the replicas x 2
    mesh, launched at the first test that asks for them (with the other modules' workers of
    that world size, :mod:`shared_launch`); ``mesh_runs.folders[replicas]`` the checkpoint
    folder the resume scenario wrote."""

    def get(replicas: int) -> list[dict[str, Any]]:
        runs = shared_launch.results(replicas * 2, "fsdp", tmp_path_factory)
        get.folders[replicas] = str(shared_launch.folder(replicas * 2, "fsdp"))  # type: ignore[attr-defined]
        return runs

    get.folders = {}  # type: ignore[attr-defined]
    return get


# -- the layout, without processes -------------------------------------------------------------
def test_a_group_layout_views_each_shard_at_its_slot_and_refuses_another_size() -> None:
    from gradzip.fsdp import GroupLayout, ShardSlot

    # A 3 x 2 weight on the last of 2 shards: 1 row of a padded 2; a 3-element bias: 1 of 2;
    # an empty shard (more shards than rows) takes its padded slot and is left out.
    slots = (ShardSlot("w", torch.Size((1, 2)), 0), ShardSlot("b", torch.Size((1,)), 4),
             ShardSlot("e", torch.Size((0, 2)), 6))
    layout = GroupLayout("block", None, None, slots, 8)
    flat = torch.arange(8.0)
    views = layout.views(flat)
    assert list(views) == ["w", "b"]
    assert torch.equal(views["w"], torch.tensor([[0.0, 1.0]]))
    assert torch.equal(views["b"], torch.tensor([4.0]))
    views["b"].fill_(-1.0)  # views: written in place, as FSDP2 needs
    assert flat[4] == -1.0
    assert layout.exchanged
    with pytest.raises(ValueError, match=r"FSDP module 'block' must be a 1-D tensor of 8 elements"):
        layout.views(torch.zeros(9))


# -- a PyTorch whose FSDP2 lacks set_reduce_scatter_unused_params (2.11) ------------------------
def _older_fsdp2_worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule

    mesh = _mesh(world, 1)
    runs = {}
    for kind in ("now", "older"):
        if kind == "older":
            # As on a PyTorch without the method: gradzip runs, every parameter taking a
            # gradient in every backward, and gives the same bits.
            del FSDPModule.set_reduce_scatter_unused_params
        model = _sharded(mesh["shard"])
        gradzip.fsdp.register(model, "topk:ratio=0.2", mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        runs[kind] = [_step(model, opt, s, rank) for s in range(3)]
    out = {"same": all(torch.equal(a[n], b[n]) for a, b in zip(runs["now"], runs["older"],
                                                                strict=True) for n in a)}
    del FSDPModule.set_all_reduce_hook  # now a PyTorch too old for the exchange at all
    try:
        gradzip.fsdp.register(_sharded(mesh["shard"]), "none", mesh=mesh)
        out["refused"] = "accepted"
    except RuntimeError as exc:
        out["refused"] = f"RuntimeError: {exc}"
    return out


def test_a_pytorch_without_unused_params_runs_and_one_without_the_hook_is_refused(
        tmp_path: Path) -> None:
    (out,) = spawn(_older_fsdp2_worker, 1, tmp_path)
    assert out["same"]
    assert out["refused"].startswith("RuntimeError: gradzip.fsdp.register needs FSDP2's "
                                     "FSDPModule.set_all_reduce_hook"), out["refused"]
