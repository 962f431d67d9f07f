"""Where a DDP step's time goes on a GPU, per configuration: the ops by device time and by host time.

    python -m benchmarks.gpu_profile [--configs C ...] [--steps N] [--warmup N] [--top K]
                                     [--out DIR]

One NCCL process (world size 1: nothing travels, so what is left is the compression's own work)
trains the ResNet-18 of ``benchmarks/gpu_step.py`` (same model, batch, buckets and hooks, built
by the same code) and runs ``--steps`` steps under ``torch.profiler`` after ``--warmup``
untimed ones. For each configuration it prints the wall time per step, the GPU's busy time
per step (the sum of its kernels' and copies' times) and the ops that take the most GPU time
and the most host time. A step whose wall time is far above its GPU time is bound by the host
(launches, Python, waits); one close to it is bound by the GPU's work. The text goes to
``gpu_profile.txt`` in ``--out`` (default ``$OUT`` when set, else ``benchmarks/results/``).
Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from ._gpu_step_plan import CONFIGS
from .gpu_step import ROOT, _build

DEFAULT = ["ddp", "torch-powersgd:rank=4", "gradzip:powersgd:rank=4", "gradzip:topk:ratio=0.01"]


def profile_config(config: str, args: argparse.Namespace, device: torch.device) -> str:
    """The report of one configuration (see the module's docstring)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    setting = {"model": "resnet18", "width": 64, "bucket_cap_mb": args.bucket_cap_mb}
    model, optimizer = _build(config, setting, device)
    gen = torch.Generator().manual_seed(1000)
    inputs = torch.randn(args.batch, 3, 32, 32, generator=gen).to(device)
    labels = torch.randint(0, 10, (args.batch,), generator=gen).to(device)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(inputs), labels).backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / args.steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    # The GPU's own events (kernels, copies), not the host ops that launched them (whose
    # device times repeat their kernels') nor the annotations that span a region.
    device_events = [e for e in prof.events() if e.device_type == DeviceType.CUDA
                     and not getattr(e, "is_user_annotation", False)
                     and not e.name.startswith(("DistributedDataParallel", "Optimizer"))]
    busy = sum(e.time_range.elapsed_us() for e in device_events) / args.steps / 1e3
    ops = sum(e.count for e in events if e.key.startswith("aten::")) / args.steps
    lines = [f"## {config}",
             f"wall {1e3 * wall:.2f} ms/step (unprofiled), GPU busy {busy:.2f} ms/step, "
             f"{ops:.0f} aten ops/step (nested calls included)", "",
             "by GPU time:",
             events.table(sort_by="self_device_time_total", row_limit=args.top, max_name_column_width=60),
             "by host time:",
             events.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=DEFAULT, choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--bucket-cap-mb", type=float, default=10.0)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--out", type=Path,
                        default=Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    if min(args.steps, args.warmup, args.batch, args.top) < 1:
        parser.error("--steps, --warmup, --batch and --top must be >= 1")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device; none is available")
    import torch.distributed as dist

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.backends.cudnn.benchmark = True
    store = Path(tempfile.mkdtemp(prefix="gradzip-prof-")) / "store"
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1,
                            device_id=device)
    reports = []
    for config in args.configs:
        report = profile_config(config, args, device)
        print(report.split("\n", 2)[1], f"[{config}]", flush=True)
        reports.append(report)
        torch.cuda.empty_cache()  # the configuration's model and buffers are gone
    dist.destroy_process_group()
    args.out.mkdir(parents=True, exist_ok=True)
    text = f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}\n\n" + "\n\n".join(reports)
    (args.out / "gpu_profile.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
