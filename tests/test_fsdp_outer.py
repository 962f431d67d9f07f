"""gradzip.ShardedOuter: outer-step training of FSDP2 models, state per shard, exchanged across
replicas only, in real gloo processes of 2 (1 x 2) and 4 (2 x 2) ranks.

One process-spawning run per mesh checks everything (process start-up is most of its time;
the run is shared with other modules' workers of the same size, see ``shared_launch``):
the ``none`` run equals the unsharded outer loop bit for bit, a PowerSGD run equals the
simulator fed the same shards bit for bit, the outer state per rank is a shard's, resume
through a DCP checkpoint is bit-identical, a NaN on one rank is skipped by every rank, and
unsupported models and meshes are refused with one line.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import gradzip
import shared_launch
from fsdp_nets import Net, refusal
from fsdp_nets import batch as _batch
from fsdp_nets import sharded as _sharded

LR = 0.05
MESHES = [(1, 2), (2, 2)]


def _inner(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, out: int) -> None:
    x, y = _batch(step, rank, out)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _local(outer: Any) -> dict[str, torch.Tensor]:
    return {n: ps[0].detach().clone() for n, ps in outer.params.items()}


# -- the `none` run: the unsharded outer loop, cut into shards --------------------------------
NONE_STEPS, NONE_PLAN = 8, {"inner_steps": 4, "fragments": 2, "delay": 1}


def _none_run(rank: int, mesh: Any) -> dict[str, torch.Tensor]:
    model = _sharded(mesh["shard"], out=1)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    outer = gradzip.ShardedOuter(model, "none", mesh=mesh, inner_optimizers=[opt], **NONE_PLAN)
    for step in range(NONE_STEPS):
        _inner(model, opt, step, rank, 1)
        outer.step()
    out = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    # The islands' mean (a fragment is in flight: they differ), gathered as the runner's
    # evaluation gathers it; the shards restored after.
    mean, kept = outer.consensus(), _local(outer)
    with torch.no_grad():
        for name, value in mean.items():
            outer.params[name][0].copy_(value)
        out.update({f"mean:{n}": p.full_tensor().clone() for n, p in model.named_parameters()})
        for name, value in kept.items():
            outer.params[name][0].copy_(value)
    assert all(torch.equal(v, out[n]) for n, v in
               {n: p.full_tensor() for n, p in model.named_parameters()}.items())
    return out


def _unsharded_reference(replicas: int, shards: int) -> list[dict[str, torch.Tensor]]:
    """The same outer loop on unsharded models in the simulator: replica ``r``'s inner step
    averages the gradients of its island's ``S`` batches, as FSDP2's reduce-scatter does.
    Each replica's parameters, and (as ``mean:<name>``) the replicas' ``consensus()``."""
    models = [Net(1) for _ in range(replicas)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    outer = gradzip.Outer(models, "none", collective=gradzip.SimulatedGroup(replicas),
                          inner_optimizers=opts, **NONE_PLAN)
    for step in range(NONE_STEPS):
        for r, (model, opt) in enumerate(zip(models, opts, strict=True)):
            grads = []
            for s in range(shards):
                model.zero_grad()
                x, y = _batch(step, r * shards + s, 1)
                nn.functional.mse_loss(model(x), y).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
            for p, *gs in zip(model.parameters(), *grads, strict=True):
                p.grad = sum(gs[1:], gs[0]) / shards
            opt.step()
        outer.step()
    mean = {f"mean:{n}": v for n, v in outer.consensus().items()}
    return [{**{n: p.detach().clone() for n, p in m.named_parameters()}, **mean} for m in models]


# -- PowerSGD: the simulator fed the same shards; state size; resume --------------------------
PSGD_STEPS, PSGD_SPEC, PSGD_PLAN = 6, "powersgd:rank=2", {"inner_steps": 2}
# A synchronisation: DCP keeps one copy of a DTensor saved by every replica (it takes it for
# replicated), so the model is saved where the replicas hold the same parameters.
SAVED_AT = 4


def _psgd_outer(model: nn.Module, mesh: Any, opt: torch.optim.Optimizer) -> Any:
    return gradzip.ShardedOuter(model, PSGD_SPEC, mesh=mesh, inner_optimizers=[opt], **PSGD_PLAN)


def _psgd_run(rank: int, world: int, mesh: Any, folder: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    model = _sharded(mesh["shard"], out=2)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    outer = _psgd_outer(model, mesh, opt)
    record: dict[str, Any] = {"initial": _local(outer), "before": [], "after": [],
                              "shard_rank": outer.shard_rank, "replica_rank": outer.replica_rank}
    for step in range(PSGD_STEPS):
        _inner(model, opt, step, rank, 2)
        record["before"].append(_local(outer))
        outer.step()
        record["after"].append(_local(outer))
        if step + 1 == SAVED_AT:
            dcp.save({"model": model.state_dict(), "outer": gradzip.fsdp.DCPEntry(outer)},
                     checkpoint_id=folder)
    record["bytes"] = outer.state_bytes()
    record["config"] = outer.checkpoint_config()

    # Resume from the DCP checkpoint into a fresh model, inner optimizer and outer loop.
    resumed = _sharded(mesh["shard"], out=2)
    with torch.no_grad():
        for p in resumed.parameters():
            p.to_local().zero_()  # nothing carried over but the checkpoint
    opt2 = torch.optim.SGD(resumed.parameters(), lr=LR, momentum=0.9)
    outer2 = _psgd_outer(resumed, mesh, opt2)
    entries = {"model": resumed.state_dict(), "outer": gradzip.fsdp.DCPEntry(outer2)}
    dcp.load(entries, checkpoint_id=folder)
    resumed.load_state_dict(entries["model"])
    for step in range(SAVED_AT, PSGD_STEPS):
        _inner(resumed, opt2, step, rank, 2)
        outer2.step()
    record["resumed"] = _local(outer2)
    record["resumed_stats"] = (outer2.inner_step, outer2.syncs)

    # The DDP path: the same outer loop on the unsharded model over every rank.
    plain = gradzip.Outer(Net(2), PSGD_SPEC, inner_steps=1)
    plain.step()
    record["ddp_bytes"] = {
        "anchor": sum(t.numel() * t.element_size() for t in plain.anchor.values()),
        "outer_state": sum(t.numel() * t.element_size() for t in plain.outer_state.values()),
        "residuals": sum(t.numel() * t.element_size() for t in plain.engine.residuals.values()),
    }
    return record


def _module_of(shapes: dict[str, torch.Size], values: dict[str, torch.Tensor]) -> nn.Module:
    """A module whose parameters have these dotted names and values (shard-shaped)."""
    root = nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, nn.Parameter(values[name].clone().reshape(shape)))
    return root


def _check_psgd_against_simulator(ranks: list[dict[str, Any]], replicas: int, shards: int) -> None:
    for shard in range(shards):
        members = sorted((r for r in ranks if r["shard_rank"] == shard),
                         key=lambda r: r["replica_rank"])
        assert len(members) == replicas
        initial = members[0]["initial"]
        models = [_module_of({n: t.shape for n, t in initial.items()}, m["initial"]) for m in members]
        ref = gradzip.Outer(models, PSGD_SPEC, collective=gradzip.SimulatedGroup(replicas),
                            **PSGD_PLAN)
        for step in range(PSGD_STEPS):
            with torch.no_grad():
                for model, member in zip(models, members, strict=True):
                    for name, p in model.named_parameters():
                        p.copy_(member["before"][step][name])
            ref.step()
            for model, member in zip(models, members, strict=True):
                for name, p in model.named_parameters():
                    assert torch.equal(p.detach(), member["after"][step][name]), (shard, step, name)
        assert ref.syncs == PSGD_STEPS // PSGD_PLAN["inner_steps"]


# -- a NaN on one rank, and what is refused ---------------------------------------------------
def _nan_run(rank: int, mesh: Any) -> dict[str, Any]:
    model = _sharded(mesh["shard"], out=2)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    outer = gradzip.ShardedOuter(model, "topk:ratio=0.5", mesh=mesh, inner_steps=1,
                                 inner_optimizers=[opt])
    _inner(model, opt, 0, rank, 2)
    outer.step()
    _inner(model, opt, 1, rank, 2)
    if rank == 0:  # one entry of one shard of one rank
        with torch.no_grad():
            model.fc1.weight.to_local()[0, 0] = float("nan")
    outer.step()
    at_anchor = all(torch.equal(ps[0], outer.anchor[n]) for n, ps in outer.params.items())
    return {"skipped": outer.skipped_syncs, "at_anchor": at_anchor, "cleared": not opt.state}


def _errors(mesh: Any, world: int) -> list[str]:
    messages = []

    def refused(fn: Any, *args: Any, **kwargs: Any) -> None:
        messages.append(refusal(fn, *args, **kwargs))

    sharded = gradzip.ShardedOuter
    refused(sharded, Net(1), mesh=mesh, inner_steps=2)  # not fully_shard-ed
    model = _sharded(mesh["shard"], out=1)
    refused(sharded, model, mesh=mesh["shard"], inner_steps=2)  # 1-D mesh
    refused(sharded, _sharded(mesh, out=1), mesh=mesh, inner_steps=2)  # native HSDP
    refused(sharded, model, mesh=mesh, inner_steps=2, collective=gradzip.SimulatedGroup(2))
    # Seven tensors, seven fragments: fc3's weight alone is a fragment, held by one shard.
    refused(sharded, model, mesh=mesh, inner_steps=7, fragments=7)
    return messages


def _worker(rank: int, world: int, replicas: int, folder: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (replicas, world // replicas),
                            mesh_dim_names=("replicate", "shard"))
    out = {"none": _none_run(rank, mesh), "psgd": _psgd_run(rank, world, mesh, folder),
           "nan": _nan_run(rank, mesh), "errors": _errors(mesh, world)}
    dist.barrier()
    return out


for _replicas, _shards in MESHES:
    shared_launch.register(_replicas * _shards, "fsdp_outer", _worker, _replicas,
                           with_folder=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("replicas,shards", MESHES)
def test_sharded_outer_equals_the_unsharded_loop_and_keeps_state_per_shard(
        replicas: int, shards: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    world = replicas * shards
    # Launched with the other modules' workers of this world size (see shared_launch).
    ranks = shared_launch.results(world, "fsdp_outer", tmp_path_factory)

    # `none`: element-wise from end to end, so every rank's gathered parameters (and the
    # islands' mean) are the unsharded loop's replica's (and its consensus), bit for bit (FSDP2's reduce-scatter averages 2 numbers: the
    # sum of two is exact in any order and halving is exact).
    reference = _unsharded_reference(replicas, shards)
    for rank, out in enumerate(ranks):
        want = reference[rank // shards]
        assert out["none"].keys() == want.keys()
        for name, value in out["none"].items():
            assert torch.equal(value, want[name]), (rank, name)

    # PowerSGD: each shard index's replica group is the simulator's outer loop over the
    # shards, bit for bit.
    records = [out["psgd"] for out in ranks]
    _check_psgd_against_simulator(records, replicas, shards)

    for record in records:
        # Resumed mid-run from DCP: the same shards as the uninterrupted run, bit for bit.
        assert record["resumed_stats"] == (PSGD_STEPS, PSGD_STEPS // 2)
        final = record["after"][-1]
        assert record["resumed"].keys() == final.keys()
        for name, value in final.items():
            assert torch.equal(record["resumed"][name], value), name
        assert record["config"]["mesh"] == f"{replicas}x{shards}"
        # Anchor, outer momentum and residuals: a shard of the DDP path's (every dimension
        # here divides by the shard count).
        for key in ("anchor", "outer_state", "residuals"):
            assert record["bytes"][key] > 0, key
            assert record["bytes"][key] * shards == record["ddp_bytes"][key], key

    for rank, out in enumerate(ranks):
        assert out["nan"] == {"skipped": 1, "at_anchor": True, "cleared": True}, rank

    expected = [
        "TypeError: `model` must be fully_shard-ed",
        "ValueError: `mesh` must be 2-D (replicate x shard), got a 1-D mesh",
        "ValueError: FSDP module '<root>' is sharded on a 2-D mesh",
        "TypeError: `collective` is not taken by ShardedOuter",
        "ValueError: `model` must give every one of the 2 shards a non-empty part of some "
        "tensor of every fragment, got fragment 5 held by 1 shards",
    ]
    for out in ranks:
        assert len(out["errors"]) == len(expected)
        for message, start in zip(out["errors"], expected, strict=True):
            assert message.startswith(start), message
            assert "\n" not in message


# -- without processes -------------------------------------------------------------------------
def test_what_is_refused_before_any_process_group_is_needed() -> None:
    with pytest.raises(TypeError, match=r"^`collective` is not taken by ShardedOuter"):
        gradzip.ShardedOuter(Net(1), mesh=None, inner_steps=1, collective=None)
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="needs an initialised torch.distributed"):
            gradzip.ShardedOuter(Net(1), mesh=None, inner_steps=1)
    for wrong in (Net(1), object()):  # a module has state_dict too, but is not gradzip state
        with pytest.raises(TypeError, match=r"^`state` must be an FSDPHookState, an FSDPScatterState or a ShardedOuter"):
            gradzip.fsdp.DCPEntry(wrong)
