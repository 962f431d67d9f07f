"""Residual memory and bytes per rank: HSDP (``gradzip.fsdp.register``), plain FSDP2 with a
compressed reduce-scatter (``gradzip.fsdp.register_reduce_scatter``) and DDP.

Runs one short training (gloo, CPU) of an MLP per mode and compressor and records, per rank,
the engine's residual bytes and its payload and wire bytes per step: HSDP on a (replicas,
shards) mesh exchanges shards over the replicate dimension; DDP (``gradzip.ddp``) and the
FSDP2 reduce-scatter exchange the whole model's gradient over every rank (the latter beside
what FSDP2's dense reduce-scatter would send). Nothing here is timed.

    python -m benchmarks.fsdp_memory            # writes benchmarks/results/fsdp_memory.json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from torch import nn

from benchmarks._common import RESULTS
from gradzip.comm import run_processes

SPECS = ("none", "topk:ratio=0.01", "powersgd:rank=4")
SIZES = (64, 256, 256, 10)
STEPS = 2


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:], strict=True)):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(SIZES) - 2 else [])
    return nn.Sequential(*layers)


def _train(model: nn.Module, rank: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, SIZES[0], generator=gen), torch.randn(16, SIZES[-1], generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _worker(rank: int, world: int, mode: str, replicas: int) -> list[dict[str, Any]]:
    import gradzip.ddp
    import gradzip.fsdp

    rows = []
    for spec in SPECS:
        if mode == "ddp":
            model: nn.Module = nn.parallel.DistributedDataParallel(_model())
            state: Any = gradzip.ddp.register(model, spec, overlap=False)
            _train(model, rank)
            engine = state.engine
        elif mode == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            model = _model()
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            state = gradzip.fsdp.register_reduce_scatter(model, spec, mesh=mesh)
            _train(model, rank)
            engine = state.engine
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (replicas, world // replicas),
                                    mesh_dim_names=("replicate", "shard"))
            model = _model()
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh["shard"])
            fully_shard(model, mesh=mesh["shard"])
            state = gradzip.fsdp.register(model, spec, mesh=mesh)
            _train(model, rank)
            engine = state.engine
        stats = engine.stats
        extra = {}
        if mode == "fsdp":
            extra["fsdp_reduce_scatter_wire_bytes_per_step"] = (
                state.stats["reduce_scatter_wire_bytes"] // STEPS)
        rows.append({
            **extra,
            "mode": mode if mode in ("ddp", "fsdp") else f"hsdp {replicas}x{world // replicas}",
            "spec": spec, "rank": rank,
            "residual_bytes": sum(r.numel() * r.element_size() for r in engine.residuals.values()),
            "payload_bytes_per_step": stats["payload_bytes"][0] // STEPS,
            "wire_bytes_per_step": stats["wire_bytes"][0] // STEPS,
            "dense_wire_bytes_per_step": stats["dense_wire_bytes"][0] // STEPS,
        })
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS / "fsdp_memory.json"))
    args = parser.parse_args(argv)
    rows = []
    for mode, world, replicas in (("ddp", 4, 4), ("hsdp", 4, 2), ("hsdp", 2, 1), ("fsdp", 4, 1)):
        for per_rank in run_processes(_worker, world, mode, replicas, timeout=600):
            rows += per_rank
    params = sum(p.numel() for p in _model().parameters())
    result = {"model": {"sizes": list(SIZES), "parameters": params}, "steps": STEPS,
              "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for row in rows:
        if row["rank"] == 0:
            print(f"{row['mode']:10s} {row['spec']:16s} residual {row['residual_bytes']:8d} B  "
                  f"wire/step {row['wire_bytes_per_step']:8d} B  (dense {row['dense_wire_bytes_per_step']})")
    return result


if __name__ == "__main__":
    main()
