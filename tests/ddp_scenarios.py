"""What the DDP hook tests run inside their gloo process groups.

:func:`main_group` runs every scenario in one group of processes (starting processes is the
slow part) and returns plain results that ``test_ddp.py`` checks one by one; :func:`resume_group`
continues the checkpoints written by the first group in fresh processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as builtin_psgd
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip.ddp
from ddp_helpers import (
    ALL_SPECS,
    ONE_BUCKET_MB,
    TINY_BUCKET_MB,
    Branchy,
    batch,
    clone_tree,
    flat_params,
    mlp,
    replicas_identical,
    train_ddp,
    train_simulated,
    trees_equal,
)

BUCKETS = {"one": ONE_BUCKET_MB, "tiny": TINY_BUCKET_MB}
SIM_SPECS = ("topk:ratio=0.1", "powersgd:rank=2")
RESUME_SPECS = ("powersgd:rank=2", "topk:ratio=0.1", "threshold:budget=0.05")
RESUME_TOTAL, RESUME_AT = 6, 3
BUILTIN_SIZES = (32, 64, 64, 8)
BUILTIN_STEPS, BUILTIN_RANK, BUILTIN_START = 30, 2, 2


def _summary(run: dict[str, Any]) -> dict[str, Any]:
    return {k: run[k] for k in ("params", "losses", "identical", "finite", "stats")}


def ckpt_path(folder: Path, spec: str, rank: int | str) -> Path:
    safe = spec.replace(":", "_").replace("=", "").replace(",", "_")
    return folder / f"ckpt-{safe}-rank{rank}.pt"


# -- scenarios --------------------------------------------------------------------------------
def parity_plain(rank: int) -> dict[str, Any]:
    """Plain DDP against the ``none`` hook, one bucket and several, 4 steps."""
    out = {}
    for label, mb in BUCKETS.items():
        out[f"plain-{label}"] = _summary(train_ddp(rank, spec=None, steps=4, bucket_cap_mb=mb))
        out[f"none-{label}"] = _summary(train_ddp(rank, spec="none", steps=4, bucket_cap_mb=mb))
    out["none-tiny-view"] = _summary(
        train_ddp(rank, spec="none", steps=4, bucket_cap_mb=TINY_BUCKET_MB,
                  gradient_as_bucket_view=True)
    )
    return out


def parity_simulated(rank: int) -> dict[str, Any]:
    """Deterministic compressors against the simulator, also under gradient accumulation."""
    out: dict[str, Any] = {}
    for spec in SIM_SPECS:
        for label, mb in BUCKETS.items():
            out[f"{spec}-{label}"] = _summary(train_ddp(rank, spec=spec, steps=4, bucket_cap_mb=mb))
        out[f"{spec}-sim"] = train_simulated(spec, steps=4) if rank == 0 else None
    # Two micro-batches per optimizer step, the first under no_sync().
    spec = "powersgd:rank=2"
    out["accum"] = _summary(
        train_ddp(rank, spec=spec, steps=3, bucket_cap_mb=TINY_BUCKET_MB, micro_batches=2)
    )
    out["accum-sim"] = train_simulated(spec, steps=3, micro_batches=2) if rank == 0 else None
    return out


def every_spec(rank: int) -> dict[str, Any]:
    """Every compressor, one bucket and several, 3 steps."""
    out = {}
    for spec in (*ALL_SPECS, "threshold:lam=0.05"):
        for label, mb in BUCKETS.items():
            run = train_ddp(rank, spec=spec, steps=3, bucket_cap_mb=mb)
            out[(spec, label)] = {**_summary(run), "buckets": _bucket_count(run["ddp"])}
    return out


def _bucket_count(ddp: DDP) -> int:
    return len(ddp.reducer._get_zeros_like_grad_buckets())


def low_precision(rank: int) -> dict[str, Any]:
    """Parameters (so buckets and gradients) in bf16 and fp16; fp32 parameters under autocast."""
    out: dict[str, Any] = {}
    for dtype in (torch.bfloat16, torch.float16):
        for spec in ("none", "fp16", "powersgd:rank=2", "topk:ratio=0.1", "threshold:budget=0.05"):
            run = train_ddp(rank, spec=spec, steps=3, bucket_cap_mb=TINY_BUCKET_MB, dtype=dtype,
                            lr=0.02)
            out[(str(dtype), spec)] = {
                **_summary(run),
                "param_dtypes": sorted({str(p.dtype) for p in run["model"].parameters()}),
                "residual_dtypes": sorted(
                    {str(r.dtype) for r in run["state"].engine.residuals.values()}
                ),
            }
    model = mlp()
    ddp = DDP(model, bucket_cap_mb=TINY_BUCKET_MB)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = gradzip.ddp.register(ddp, "powersgd:rank=2")
    identical = []
    for step in range(3):
        x, y = batch(step, rank)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(ddp(x).float(), y)
        loss.backward()
        opt.step()
        identical.append(replicas_identical(model))
    out["autocast"] = {"identical": identical, "finite": bool(torch.isfinite(flat_params(model)).all()),
                       "stats": state.stats}
    return out


def grad_scaler(rank: int) -> dict[str, Any]:
    """An Inf gradient on one rank: the scaler skips the step and gradzip's state is kept.

    Step 2: Inf only in the first layer's weight gradient (the *last* bucket, after earlier
    buckets already changed state); step 3: Inf input, every gradient non-finite.
    """
    model = mlp()
    ddp = DDP(model, bucket_cap_mb=TINY_BUCKET_MB)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = gradzip.ddp.register(ddp, "powersgd:rank=2", optimizer=opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    checks: dict[int, dict[str, Any]] = {}
    identical = []
    for step in range(5):
        x, y = batch(step, rank)
        handle = None
        if rank == 1 and step == 2:
            handle = model[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")))
        if rank == 1 and step == 3:
            x[0, 0] = float("inf")
        before = (clone_tree(state.state_dict()), flat_params(model), scaler.get_scale())
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        scaler.scale(loss).backward()
        grads_finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        scaler.step(opt)
        scaler.update()
        if handle is not None:
            handle.remove()
        after = state.state_dict()
        checks[step] = {
            "grads_finite": grads_finite,
            "params_kept": torch.equal(before[1], flat_params(model)),
            "scale_before": before[2],
            "scale_after": scaler.get_scale(),
            "residuals_kept": trees_equal(before[0]["residuals"], after["residuals"]),
            "compressor_state_kept": trees_equal(
                before[0]["compressor_state"], after["compressor_state"]
            ),
            "engine_step": after["step"],
            "skipped_steps": after["skipped_steps"],
        }
        identical.append(replicas_identical(model))
    return {"checks": checks, "identical": identical, "stats": state.stats,
            "finite": bool(torch.isfinite(flat_params(model)).all())}


def train_branchy(rank: int, spec: str, bucket_cap_mb: float,
                  hook_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Three steps of :class:`Branchy` through the hook with ``find_unused_parameters=True``:
    its ``unused`` layer never takes part, its ``odd`` layer on odd ranks only.

    Args:
        rank: this process's rank.
        spec: the compressor.
        bucket_cap_mb: DDP's bucket cap.
        hook_kwargs: further keywords of ``gradzip.ddp.register``.

    Returns:
        ``params`` (flat, after training), the hook's ``stats``, ``identical`` (replicas
        equal after each step), ``finite``, ``unused_kept`` (the unused layer unchanged) and
        ``odd_trained`` (the odd layer changed).
    """
    model = Branchy()
    unused0, odd0 = flat_params(model.unused), flat_params(model.odd)
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb, find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = gradzip.ddp.register(ddp, spec, optimizer=opt, **(hook_kwargs or {}))
    identical = []
    for step in range(3):
        x, y = batch(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x, use_odd=rank % 2 == 1), y).backward()
        opt.step()
        identical.append(replicas_identical(model))
    params = flat_params(model)
    return {"params": params, "stats": state.stats, "identical": identical,
            "finite": bool(torch.isfinite(params).all()),
            "unused_kept": torch.equal(unused0, flat_params(model.unused)),
            "odd_trained": not torch.equal(odd0, flat_params(model.odd))}


def unused_parameters(rank: int) -> dict[str, Any]:
    """``find_unused_parameters=True``: one layer never used, one used on odd ranks only."""
    out = {}
    for spec in ("powersgd:rank=2", "topk:ratio=0.1", "threshold:budget=0.05"):
        for label, mb in BUCKETS.items():
            run = train_branchy(rank, spec, mb)
            out[(spec, label)] = {"identical": run["identical"], "finite": run["finite"],
                                  "unused_kept": run["unused_kept"],
                                  "odd_trained": run["odd_trained"],
                                  "steps": run["stats"]["steps"]}
    return out


def _builtin_bytes_formula(model: nn.Module, steps: int) -> int:
    """What powerSGD_hook all-reduces over ``steps`` iterations with one bucket, in bytes:
    the whole bucket (fp32) for the first ``start_powerSGD_iter`` iterations, then per step
    the uncompressed tensors, every P (rows x r) and every Q (cols x r), all fp32."""
    dense = compressed = 0
    for p in model.parameters():
        rows, cols = p.shape[0], p.numel() // p.shape[0]
        r = min(rows, cols, BUILTIN_RANK)
        dense += p.numel()
        if (rows + cols) * r * 2 < rows * cols:  # its _should_compress, min_compression_rate=2
            compressed += (rows + cols) * r
        else:
            compressed += p.numel()
    return 4 * (BUILTIN_START * dense + (steps - BUILTIN_START) * compressed)


def against_builtin_powersgd(rank: int) -> dict[str, Any]:
    """PyTorch's powerSGD_hook vs gradzip's PowerSGD, same rank, model, data; one bucket."""
    x_eval, y_eval = batch(10_000, 0, n=256, sizes=(BUILTIN_SIZES[0], BUILTIN_SIZES[-1]))
    out: dict[str, Any] = {}
    counted: list[int] = []
    original = dist.all_reduce

    def counting_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counted.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    builtin_state = builtin_psgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=BUILTIN_RANK,
        start_powerSGD_iter=BUILTIN_START, random_seed=0,
    )
    dist.all_reduce = counting_all_reduce  # powerSGD_hook calls dist.all_reduce
    try:
        builtin = train_ddp(rank, spec=None, steps=BUILTIN_STEPS, model=mlp(BUILTIN_SIZES),
                            sizes=(BUILTIN_SIZES[0], BUILTIN_SIZES[-1]),
                            hook=(builtin_state, builtin_psgd.powerSGD_hook))
    finally:
        dist.all_reduce = original
    ours = train_ddp(rank, spec=f"powersgd:rank={BUILTIN_RANK}", steps=BUILTIN_STEPS,
                     model=mlp(BUILTIN_SIZES), sizes=(BUILTIN_SIZES[0], BUILTIN_SIZES[-1]))
    for name, run in (("builtin", builtin), ("gradzip", ours)):
        with torch.no_grad():
            loss = float(nn.functional.mse_loss(run["model"](x_eval), y_eval))
        out[name] = {"eval_loss": loss, "identical": run["identical"], "losses": run["losses"]}
    with torch.no_grad():
        out["initial_eval_loss"] = float(nn.functional.mse_loss(mlp(BUILTIN_SIZES)(x_eval), y_eval))
    out["builtin"]["bytes_measured"] = sum(counted)
    out["builtin"]["bytes_formula"] = _builtin_bytes_formula(builtin["model"], BUILTIN_STEPS)
    out["builtin"]["buckets"] = _bucket_count(builtin["ddp"])
    out["gradzip"]["stats"] = ours["stats"]
    return out


def resume_first_half(rank: int, folder: Path) -> dict[str, Any]:
    """Uninterrupted runs, and runs stopped after RESUME_AT steps with per-rank checkpoints
    (and one gathered checkpoint, written by rank 0 only)."""
    out = {}
    for spec in RESUME_SPECS:
        full = train_ddp(rank, spec=spec, steps=RESUME_TOTAL, bucket_cap_mb=TINY_BUCKET_MB)
        part = train_ddp(rank, spec=spec, steps=RESUME_AT, bucket_cap_mb=TINY_BUCKET_MB)
        ckpt = {
            "model": part["model"].state_dict(),
            "optimizer": part["opt"].state_dict(),
            "gradzip": part["state"].state_dict(),
        }
        torch.save(ckpt, ckpt_path(folder, spec, rank))
        gathered = part["state"].gathered().state_dict()  # a collective: every rank calls it
        if rank == 0:
            torch.save({**ckpt, "gradzip": gathered}, ckpt_path(folder, spec, "all"))
        out[spec] = {"full": _summary(full), "part_stats": part["stats"],
                     "saved": clone_tree(ckpt["gradzip"])}
    return out


# -- process entry points ---------------------------------------------------------------------
def main_group(rank: int, world: int, folder: Path) -> dict[str, Any]:
    results = {
        "parity_plain": parity_plain(rank),
        "parity_simulated": parity_simulated(rank),
        "every_spec": every_spec(rank),
        "low_precision": low_precision(rank),
        "grad_scaler": grad_scaler(rank),
        "unused_parameters": unused_parameters(rank),
        "builtin": against_builtin_powersgd(rank),
        "resume": resume_first_half(rank, folder),
    }
    return results


def resume_group(rank: int, world: int, folder: Path) -> dict[str, Any]:
    """Fresh processes: a differently initialised model, then model, optimizer and gradzip
    state loaded (``weights_only=True``) from this rank's files, and for PowerSGD also from
    the gathered checkpoint; then training continues to RESUME_TOTAL steps."""
    out = {}
    runs = [(spec, "rank") for spec in RESUME_SPECS] + [("powersgd:rank=2", "all")]
    for spec, source in runs:
        ckpt = torch.load(ckpt_path(folder, spec, rank if source == "rank" else "all"),
                          weights_only=True)
        loaded: dict[str, Any] = {}

        def setup(model: nn.Module, opt: torch.optim.Optimizer, state: Any,
                  ckpt: dict[str, Any] = ckpt, loaded: dict[str, Any] = loaded) -> None:
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
            state.load_state_dict(ckpt["gradzip"])
            loaded["state"] = clone_tree(state.state_dict())

        run = train_ddp(rank, spec=spec, steps=RESUME_TOTAL - RESUME_AT, start=RESUME_AT,
                        bucket_cap_mb=TINY_BUCKET_MB, model=mlp(seed=99), setup=setup)
        out[(spec, source)] = {**_summary(run), "loaded": loaded["state"]}
    return out
