"""Seconds per DDP training step on CUDA: native DDP, PyTorch's hooks and gradzip, side by side.

    python -m benchmarks.gpu_step [--out DIR] [--dry-run] [--device auto|cuda|cpu]
                                  [--budget-s S] [--row-timeout S] [--steps N] [--warmup N]

A ResNet-18 (CIFAR variant, 11.2M parameters, 44.7 MB of fp32 gradients, several DDP buckets
at ``--bucket-cap-mb``) trains on synthetic 32x32 inputs, ``--batch`` samples per rank. Every
row is one configuration in one *setup* (backend, world size, placement); its time is the
median over ``--steps`` steps after ``--warmup`` untimed ones, each step bracketed by
``torch.cuda.synchronize()`` and taken as the slowest rank's. Ratios are to native DDP in the
same setup.

Setups, chosen from the GPUs present:

* two or more GPUs: ``nccl`` with two ranks, one GPU each;
* one GPU: NCCL refuses two ranks on one device ("Duplicate GPU detected"), so the two ranks
  share it over ``gloo`` with CUDA tensors (gloo stages them through host memory: this times
  the hooks' host syncs and copies, not NCCL's speed);
* with any GPU, also ``nccl`` with one rank: nothing travels (a one-rank collective is a
  copy), so it times the compression arithmetic a hook adds to a step;
* ``--device cpu``: ``gloo`` with two ranks on the CPU and a tiny model, to exercise this
  script where there is no GPU.

In NCCL setups each row then runs ``--sync-steps`` more steps under
``torch.cuda.set_sync_debug_mode("warn")`` and reports the host syncs per step, by the Python
line that made them (the ``host syncs/step`` column; the call sites are printed before the
table and kept in the JSON). Syncs made inside PyTorch's C++ (gloo's staging copies) are not
seen, which is why gloo setups are not counted.

Robustness: each setup's ranks run in fresh processes; each row reports when it starts and
ends. A row that raises is recorded with its error and the next row runs; a row that exceeds
``--row-timeout`` (a hang) gets its processes killed, is recorded as a timeout, and the setup
restarts after it. Rows that would start after ``--budget-s`` are recorded as skipped. Results
go to ``gpu_step.json`` and ``gpu_step.md`` in ``--out`` (default ``$OUT`` when set, else
``benchmarks/results/``); the Markdown table is printed last. The configurations, the setup
plan and the table are in ``_gpu_step_plan.py`` beside this file.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue
import sys
import time
import traceback
import warnings
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from gradzip.comm.launch import free_port

from ._gpu_step_plan import CONFIGS, finish_row, make_row, plan, sync_sites, table

ROOT = Path(__file__).resolve().parents[1]

ONE_BUCKET_MB = 1024.0  # PyTorch's PowerSGD hook runs with the whole model in one bucket


# -- the worker (one rank) -----------------------------------------------------------------
def _build(config: str, args: dict[str, Any], device: torch.device) -> tuple[Any, Any]:
    """The model for ``config`` (wrapped in DDP with its hook) and its optimizer."""
    from torch.nn.parallel import DistributedDataParallel

    import gradzip.ddp
    from gradzip.train.models import build_model

    torch.manual_seed(0)  # identical initial weights on every rank and for every config
    model = build_model(args["model"], 10, width=args["width"]).to(device)
    if config == "local":
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    one_bucket = config.startswith("torch-powersgd")
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=ONE_BUCKET_MB if one_bucket else args["bucket_cap_mb"],
    )
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    if config == "torch-fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif one_bucket:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=int(config.rpartition("=")[2]),
            start_powerSGD_iter=2, random_seed=0,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif config.startswith("gradzip:"):
        gradzip.ddp.register(ddp, config.partition(":")[2], optimizer=optimizer)
    elif config != "ddp":
        raise ValueError(f"unknown configuration {config!r}")
    return ddp, optimizer


def _time_config(
    config: str, args: dict[str, Any], device: torch.device, rank: int
) -> tuple[list[float], dict[str, Any] | None]:
    """Seconds of each timed step of ``config`` on this rank, and its host syncs (NCCL only)."""
    model, optimizer = _build(config, args, device)
    gen = torch.Generator().manual_seed(1000 + rank)
    inputs = torch.randn(args["batch"], 3, 32, 32, generator=gen).to(device)
    labels = torch.randint(0, 10, (args["batch"],), generator=gen).to(device)
    loss_fn = torch.nn.CrossEntropyLoss()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(inputs), labels).backward()
        optimizer.step()

    for _ in range(args["warmup"]):
        step()
    times = []
    for _ in range(args["steps"]):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return times, (_count_syncs(step, args["sync_steps"]) if args["count_syncs"] else None)


def _site(filename: str, lineno: int) -> str:
    for marker in ("/src/", "/site-packages/"):
        if marker in filename:
            filename = filename.rsplit(marker, 1)[1]
    return f"{filename}:{lineno}"


def _count_syncs(step: Any, steps: int) -> dict[str, Any]:
    """Host syncs during ``steps`` more steps, by the Python line that made them.

    ``torch.cuda.set_sync_debug_mode("warn")`` turns each synchronising call into a warning
    attributed to its Python caller. Global state: it also sees the calls a DDP hook makes
    from autograd's device thread. Only with NCCL: gloo's own staging copies of CUDA tensors
    would be counted (and warned about from its C++ threads) too.
    """
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    sites = Counter(_site(w.filename, w.lineno) for w in caught
                    if "called a synchronizing CUDA operation" in str(w.message))
    return {"per_step": sum(sites.values()) / steps, "steps": steps,
            "sites": {k: v / steps for k, v in sites.most_common()}}


def _worker(rank: int, setup: dict[str, Any], port: int, configs: list[str],
            args: dict[str, Any], out: Any) -> None:
    """One rank of ``setup``: every config in turn, each reported as it starts and ends."""
    import torch.distributed as dist

    try:
        if setup["device"] == "cuda":
            index = rank if setup["backend"] == "nccl" else 0
            torch.cuda.set_device(index)
            device = torch.device("cuda", index)
            torch.backends.cudnn.benchmark = True
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 2) // setup["world"]))
            device = torch.device("cpu")
        dist.init_process_group(
            setup["backend"], init_method=f"tcp://127.0.0.1:{port}", rank=rank,
            world_size=setup["world"], timeout=timedelta(seconds=args["row_timeout"]),
            # NCCL binds its communicator to this rank's GPU (else it guesses, and warns).
            device_id=device if setup["backend"] == "nccl" else None,
        )
        for config in configs:
            out.put(("start", rank, config, None))
            try:
                dist.barrier()  # every rank starts the row together
                out.put(("done", rank, config, _time_config(config, args, device, rank)))
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # the row's model and buffers are gone
            except Exception:  # noqa: BLE001 - recorded in the row; the next row still runs
                out.put(("error", rank, config, traceback.format_exc(limit=6)))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a failure outside any row (start-up)
        out.put(("fatal", rank, None, traceback.format_exc(limit=6)))
    out.put(("exit", rank, None, None))


# -- the parent ------------------------------------------------------------------------------
def run_setup(setup: dict[str, Any], configs: list[str], args: dict[str, Any],
              deadline: float, log: Any) -> list[dict[str, Any]]:
    """Every config of one setup, restarting the processes after a row that hangs."""
    ctx = mp.get_context("spawn")
    rows: dict[str, dict[str, Any]] = {}
    pending = list(configs)
    while pending:
        if time.monotonic() >= deadline:
            for config in pending:
                rows[config] = make_row(setup, config, error="skipped: --budget-s spent")
            break
        out = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, setup, port, pending, args, out), daemon=True)
                 for r in range(setup["world"])]
        for proc in procs:
            proc.start()
        reports: dict[str, dict[int, tuple[str, Any]]] = {}
        exited, fatal = 0, None
        # The first row also pays for process start-up and CUDA/NCCL initialisation.
        row_deadline = time.monotonic() + args["row_timeout"] + args["startup_s"]
        while exited < setup["world"]:
            limit = min(row_deadline, deadline)
            try:
                kind, rank, config, value = out.get(timeout=max(0.05, min(1.0, limit - time.monotonic())))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if time.monotonic() < limit and not dead:
                    continue
                why = ("timeout: no progress in --row-timeout" if time.monotonic() >= row_deadline
                       else "killed: --budget-s spent" if time.monotonic() >= deadline
                       else f"a rank died (exit code {dead[0].exitcode})")
                # Rows finish in order: the oldest unfinished one is the culprit (a rank that
                # raised may have moved on while another waits in a collective of that row).
                victim = pending[0]
                partial = [f"rank {r}: {v}" for r, (_, v) in sorted(reports.get(victim, {}).items())]
                rows[victim] = make_row(setup, victim, error="\n".join([*partial, why]))
                log(f"  {setup['name']} {victim}: {why}")
                pending = pending[1:]
                break
            if kind == "start":
                row_deadline = time.monotonic() + args["row_timeout"]
            elif kind in ("done", "error"):
                reports.setdefault(config, {})[rank] = (kind, value)
                if len(reports[config]) == setup["world"]:
                    rows[config] = finish_row(setup, config, reports[config])
                    log(f"  {setup['name']} {config}: " + (
                        f"{rows[config]['median_s'] * 1e3:.1f} ms" if rows[config]["error"] is None
                        else rows[config]["error"].strip().splitlines()[-1]))
                    pending = [c for c in pending if c != config]
            elif kind == "fatal":
                fatal = value
            elif kind == "exit":
                exited += 1
        else:  # every rank exited: whatever is still pending never ran
            why = f"setup failed:\n{fatal}" if fatal is not None else "not reported by every rank"
            for config in pending:
                rows[config] = make_row(setup, config, error=why)
            pending = []
        for proc in procs:
            proc.join(timeout=3)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=3)
    return [rows[c] for c in configs if c in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to plan for (default: detected)")
    parser.add_argument("--dry-run", action="store_true", help="list what would run, run nothing")
    parser.add_argument("--budget-s", type=float, default=330.0, help="no row starts after this")
    parser.add_argument("--row-timeout", type=float, default=75.0)
    parser.add_argument("--startup-s", type=float, default=60.0, help="extra time for a setup's first row")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=None, help="per rank (default 128; 8 on cpu)")
    parser.add_argument("--model", default=None, help="default resnet18 (resnet8 on cpu)")
    parser.add_argument("--width", type=int, default=None, help="default 64 (4 on cpu)")
    parser.add_argument("--bucket-cap-mb", type=float, default=10.0)
    parser.add_argument("--sync-steps", type=int, default=10,
                        help="extra steps in which host syncs are counted (NCCL setups; 0: off)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--setups", nargs="+", default=None,
                        help="run only these setups (names as the dry run lists them)")
    ns = parser.parse_args(argv)
    if ns.warmup < 3:
        parser.error(f"--warmup must be >= 3 (DDP rebuilds its buckets after step 1 and "
                     f"PyTorch's PowerSGD compresses from step 3), got {ns.warmup}")
    if ns.steps < 1 or ns.row_timeout <= 0 or ns.budget_s <= 0 or ns.sync_steps < 0:
        parser.error("--steps, --row-timeout and --budget-s must be positive, --sync-steps >= 0")
    gpus = ns.gpus if ns.gpus is not None else torch.cuda.device_count()
    device = ns.device if ns.device != "auto" else ("cuda" if gpus > 0 else "cpu")
    if device == "cuda" and gpus < 1:
        parser.error("--device cuda needs a GPU (or --gpus N with --dry-run)")
    cpu = device == "cpu"
    args = {"model": ns.model or ("resnet8" if cpu else "resnet18"),
            "width": ns.width or (4 if cpu else 64), "batch": ns.batch or (8 if cpu else 128),
            "steps": ns.steps, "warmup": ns.warmup, "bucket_cap_mb": ns.bucket_cap_mb,
            "row_timeout": ns.row_timeout, "startup_s": ns.startup_s,
            "count_syncs": False, "sync_steps": ns.sync_steps}
    setups = plan(device, gpus)
    if ns.setups is not None:
        unknown = sorted(set(ns.setups) - {x["name"] for x in setups})
        if unknown:
            parser.error(f"--setups must name setups of this plan "
                         f"({', '.join(x['name'] for x in setups)}), got {', '.join(unknown)}")
        setups = [x for x in setups if x["name"] in ns.setups]
    if ns.dry_run:
        print(f"would run on {device} ({gpus} GPU(s)), model {args['model']} width {args['width']}, "
              f"batch {args['batch']} per rank, {args['warmup']} warm-up + {args['steps']} timed "
              f"steps per row, budget {ns.budget_s:g} s, row timeout {ns.row_timeout:g} s")
        for setup in setups:
            print(f"setup {setup['name']}: backend {setup['backend']}, {setup['world']} rank(s); "
                  f"{setup['placement']}")
            for config in ns.configs:
                print(f"  row {setup['name']} {config}: {CONFIGS[config]}")
        print(f"would write {Path(ns.out) / 'gpu_step.json'} and {Path(ns.out) / 'gpu_step.md'}")
        return 0
    started = time.monotonic()
    deadline = started + ns.budget_s
    rows: list[dict[str, Any]] = []
    for setup in setups:
        print(f"setup {setup['name']}: {setup['placement']}", flush=True)
        counting = setup["backend"] == "nccl" and ns.sync_steps > 0
        rows += run_setup(setup, list(ns.configs), {**args, "count_syncs": counting}, deadline,
                          lambda msg: print(msg, flush=True))
    meta = {
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "gpus": gpus, "gpu_name": torch.cuda.get_device_name(0) if gpus else None,
        "cpu_count": os.cpu_count(), "args": args, "setups": setups,
        "configs": {c: CONFIGS[c] for c in ns.configs}, "wall_s": time.monotonic() - started,
        "timing": "per step: cuda.synchronize, step, cuda.synchronize; slowest rank per step; "
                  "median over steps",
    }
    out_dir = Path(ns.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_step.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = table(rows)
    (out_dir / "gpu_step.md").write_text(
        f"{args['model']} (width {args['width']}), batch {args['batch']} per rank, "
        f"{args['steps']} timed steps after {args['warmup']}; {meta['gpu_name'] or 'CPU'}, "
        f"torch {meta['torch']}\n\n{md}\n")
    sites = sync_sites(rows)
    if sites:
        print("\nhost syncs per step, by call site:\n" + sites)
    print(f"\nwrote {out_dir / 'gpu_step.json'} ({meta['wall_s']:.0f} s)\n")
    print(md)
    return 0 if all(r["error"] is None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
