"""Helpers of the DDP hook tests: spawn gloo process groups, tiny models, deterministic data.

Everything here runs inside worker processes started by :func:`spawn` (spawn start method,
one CPU thread each, a FileStore rendezvous in a temporary folder, and timeouts everywhere so
that a hang fails the test instead of blocking it).
"""

from __future__ import annotations

import io
import multiprocessing as mp
import time
import traceback
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip.ddp
from gradzip import Engine, SimulatedGroup

COLLECTIVE_TIMEOUT_S = 60
ALL_SPECS = (
    "none", "fp16", "bf16", "topk:ratio=0.1", "randk:ratio=0.1", "threshold:budget=0.05",
    "powersgd:rank=2", "qsgd", "sign",
)
ONE_BUCKET_MB = 25.0
TINY_BUCKET_MB = 1e-5  # 10 bytes: after DDP's rebuild every parameter has its own bucket


# -- processes ------------------------------------------------------------------------------
def _entry(fn: Callable[..., Any], rank: int, world: int, folder: str, args: tuple[Any, ...],
           backend: str = "gloo") -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend, init_method=f"file://{folder}/store", rank=rank, world_size=world,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
            time.sleep(0.05)  # gloo's threads release their last tensors before exit
        torch.save(result, f"{folder}/result-{rank}.pt")
    except BaseException:
        Path(f"{folder}/error-{rank}.txt").write_text(traceback.format_exc())
        raise


def spawn(
    fn: Callable[..., Any], world: int, folder: Path, *args: Any, timeout: float = 240.0,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` fresh processes joined by a gloo group
    (or ``backend``'s).

    Returns the return values in rank order; raises ``RuntimeError`` with the workers'
    tracebacks when one fails, and ``TimeoutError`` (after killing them) when they hang.
    """
    folder.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(fn, r, world, str(folder), args, backend)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    failed_at = None
    try:
        while any(p.is_alive() for p in procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fn.__name__} did not finish within {timeout} s")
            if any(p.exitcode not in (None, 0) for p in procs):
                failed_at = failed_at or time.monotonic()
                if time.monotonic() - failed_at > 5:  # the others are stuck in a collective
                    break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    errors = sorted(folder.glob("error-*.txt"))
    if errors or any(p.exitcode != 0 for p in procs):
        text = "\n".join(e.read_text() for e in errors)
        raise RuntimeError(f"worker failed (exit codes {[p.exitcode for p in procs]}):\n{text}")
    return [torch.load(folder / f"result-{r}.pt", weights_only=False) for r in range(world)]


# -- models and data --------------------------------------------------------------------------
def mlp(sizes: Iterable[int] = (12, 32, 16, 4), seed: int = 0) -> nn.Sequential:
    """A small ReLU network, initialised from an explicit generator."""
    sizes = list(sizes)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    init_(model, seed)
    return model


def init_(model: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            fan_in = p.shape[1] if p.dim() > 1 else p.shape[0]
            p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)


def chain(n: int) -> nn.Sequential:
    """A ReLU chain of Linear layers with exactly ``n`` parameters (the last layer has no bias
    when ``n`` is odd): with a tiny bucket cap, ``n`` buckets after DDP's rebuild."""
    dims = [12] + [8] * ((n + 1) // 2 - 1) + [4]
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
        layers += [nn.Linear(a, b, bias=not (n % 2 and i == len(dims) - 2)), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    init_(model, n)
    return model

class Branchy(nn.Module):
    """``unused`` never takes part; ``odd`` only on odd ranks (``find_unused_parameters``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 32)
        self.fc2 = nn.Linear(32, 4)
        self.unused = nn.Linear(32, 4)
        self.odd = nn.Linear(32, 4)
        init_(self, 3)

    def forward(self, x: torch.Tensor, use_odd: bool = False) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        out = self.fc2(h)
        return out + self.odd(h) if use_odd else out


def batch(step: int, rank: int, micro: int = 0, n: int = 8, sizes: tuple[int, int] = (12, 4),
          dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """A regression batch, fixed by ``(step, rank, micro)``: targets of a fixed linear teacher."""
    teacher = torch.randn(sizes, generator=torch.Generator().manual_seed(12345)) / sizes[0] ** 0.5
    gen = torch.Generator().manual_seed(100_003 * step + 1_009 * rank + 17 * micro + 1)
    x = torch.randn(n, sizes[0], generator=gen)
    y = x @ teacher + 0.1 * torch.randn(n, sizes[1], generator=gen)
    return x.to(dtype), y.to(dtype)


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def replicas_identical(model: nn.Module) -> bool:
    """All-gather every parameter and compare bit for bit (NaN counts as different)."""
    flat = flat_params(model)
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return all(torch.equal(out[0], o) for o in out[1:])


def clone_tree(obj: Any) -> Any:
    """A deep copy of a state dict through torch.save (what a checkpoint round trip does)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def trees_equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(trees_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(trees_equal, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


# -- training loops ---------------------------------------------------------------------------
def train_ddp(
    rank: int,
    *,
    spec: str | None,
    steps: int,
    bucket_cap_mb: float = ONE_BUCKET_MB,
    model: nn.Module | None = None,
    micro_batches: int = 1,
    dtype: torch.dtype = torch.float32,
    start: int = 0,
    lr: float = 0.05,
    sizes: tuple[int, int] = (12, 4),
    hook: tuple[Any, Callable[..., Any]] | None = None,
    setup: Callable[[nn.Module, torch.optim.Optimizer, Any], None] | None = None,
    hook_kwargs: dict[str, Any] | None = None,
    **ddp_kwargs: Any,
) -> dict[str, Any]:
    """Train a DDP model and check that replicas agree after each step.

    Plain DDP when ``spec`` and ``hook`` are None; gradzip's hook for ``spec``; any other
    ``(state, hook)`` pair through ``hook``; ``hook_kwargs`` go to :func:`gradzip.ddp.register`
    (``overlap=False`` for the synchronous hook). ``setup(model, optimizer, hook_state)`` runs
    before the first step (to load a checkpoint).

    Returns final parameters, per-step losses, replica checks and the hook's stats and state.
    """
    model = model if model is not None else mlp().to(dtype)
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb, **ddp_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    state = None
    if spec is not None:
        state = gradzip.ddp.register(ddp, spec, optimizer=opt, **(hook_kwargs or {}))
    elif hook is not None:
        ddp.register_comm_hook(*hook)
    if setup is not None:
        setup(model, opt, state)
    losses, identical = [], []
    for step in range(start, start + steps):
        opt.zero_grad()
        for micro in range(micro_batches):
            x, y = batch(step, rank, micro, sizes=sizes, dtype=dtype)
            sync = micro == micro_batches - 1
            with nullcontext() if sync else ddp.no_sync():
                loss = nn.functional.mse_loss(ddp(x), y)
                loss.backward()
            losses.append(float(loss.detach()))
        opt.step()
        identical.append(replicas_identical(model))
    return {
        "params": flat_params(model),
        "losses": losses,
        "identical": identical,
        "finite": bool(torch.isfinite(flat_params(model)).all()),
        "stats": state.stats if state is not None else None,
        "ddp": ddp,
        "state": state,
        "model": model,
        "opt": opt,
    }


def train_simulated(spec: str, *, steps: int, workers: int = 2, micro_batches: int = 1,
                    lr: float = 0.05) -> dict[str, Any]:
    """The reference: one replica, every worker's gradient computed in turn, averaged by an
    Engine on a SimulatedGroup."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    named = [(n, p) for n, p in model.named_parameters()]
    engine = Engine(named, spec, collective=SimulatedGroup(workers), optimizer=opt)
    for step in range(steps):
        per_worker: dict[str, list[torch.Tensor]] = {n: [] for n, _ in named}
        for w in range(workers):
            model.zero_grad()
            for micro in range(micro_batches):
                x, y = batch(step, w, micro)
                nn.functional.mse_loss(model(x), y).backward()
            for n, p in named:
                per_worker[n].append(p.grad.clone())
        # same_layout as the DDP hook passes: the header rides in the payload, so the messages
        # (and their bytes) are the hook's.
        averaged = engine.reduce({n: torch.stack(g) for n, g in per_worker.items()},
                                 same_layout=True)
        for n, p in named:
            p.grad = averaged[n]
        opt.step()
    return {"params": flat_params(model), "stats": engine.stats}
