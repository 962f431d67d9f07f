"""Ops a DDP communication scheme adds to a training step, counted on the CPU.

    python -m benchmarks.op_counts [--out DIR] [--steps N] [--warmup N] [--buckets B]
                                   [--only NAME ...] [--models M,...] [--decide-on device|auto]

On a GPU every ATen op a hook runs is at least one kernel launch (several microseconds of host
time, plus the Python that issues it), so a hook's cost on a small-to-medium model is set by
how many ops it runs per step, not by how many bytes it touches. A kernel launch costs nothing
on the CPU, so this script measures that cost without a GPU: it counts, with
``torch.profiler``, the ops of a few steady training steps of each scheme.

What is counted, per step:

* **ops**: leaf ATen ops (an ``aten::`` event with no ``aten::`` child other than views,
  allocations and metadata ops), except those ops themselves (:data:`NOT_COMPUTE`): each is a
  kernel a GPU would launch.
  "Extra ops" are those of the scheme's step minus those of the same step without DDP.
* **host syncs**: ops that make the host wait for the device on CUDA
  (:data:`HOST_SYNC_OPS`: a scalar read such as ``.item()``/``bool()``, ``nonzero``...).
  A ``.tolist()`` or ``.cpu()`` of a CUDA tensor also syncs but shows no distinct op on
  the CPU. A device-side assertion (``torch._assert_async``, gradzip's decode-time range
  checks) counts as one op and no sync: on the CPU it reads its value at once, on CUDA not.
  A multi-tensor op (``torch._foreach_*``) counts as one op: CUDA launches one kernel per
  batch of tensors (a few at most for a bucket), where the CPU loops over per-tensor ops.
* **collectives**: ``c10d::`` calls.

Setup: one gloo process (world size 1), so nothing travels and the figures are the
scheme's own work; DDP with ``--buckets`` buckets (``bucket_cap_mb`` set from the model's
size); gradzip's hook with ``overlap=False`` (the same work as the communication thread, run
where the profiler sees it: it records only the thread that started it) and the decision
path that CUDA tensors take forced on (``force_device_path``), and the forms of ops that
other devices take in place of the CPU's own (NumPy packing and selection, the compiled QSGD
decoder, chunked loops: ``gradzip.ops.branches.device_forms``; NumPy's work would not show
as ATen ops at all), so the counts are those of a CUDA run. PyTorch's ``powerSGD_hook`` runs
part of its work in future callbacks, which the profiler sees in some steps only: its count is
its largest step's (every other scheme's is the mean, the same in every step). Models: ResNet-18 (CIFAR variant, 62 parameter tensors) and,
for the "grows with buckets, not tensors" check, a stack of matrices split into T or 4T
tensors of the same total size.

Results go to ``op_counts.json`` and ``op_counts.md`` in ``--out`` (default
``benchmarks/results/``); the Markdown table is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradzip
from gradzip.ops.branches import device_forms
from gradzip.train.models import build_model

RESULTS = Path(__file__).resolve().parent / "results"

#: Leaf ops that launch no kernel: views, allocations and metadata.
NOT_COMPUTE = frozenset({
    "aten::view", "aten::_unsafe_view", "aten::as_strided", "aten::reshape", "aten::_reshape_alias",
    "aten::view_as", "aten::expand", "aten::expand_as", "aten::slice", "aten::select",
    "aten::narrow", "aten::unsqueeze", "aten::squeeze", "aten::t", "aten::transpose",
    "aten::permute", "aten::unbind", "aten::split", "aten::split_with_sizes", "aten::chunk",
    "aten::flatten", "aten::unflatten", "aten::alias", "aten::detach", "aten::detach_",
    "aten::lift_fresh", "aten::empty", "aten::empty_like", "aten::empty_strided",
    "aten::resize_", "aten::set_", "aten::result_type", "aten::contiguous", "aten::numpy_T",
    "aten::_has_compatible_shallow_copy_type", "aten::is_nonzero", "aten::item",
    "aten::broadcast_tensors", "aten::view_as_real", "aten::view_as_complex", "aten::diagonal",
    "aten::movedim", "aten::swapaxes", "aten::unfold", "aten::chalf", "aten::real",
    # A conjugation or negation "resolved" on a real tensor is a no-op (matmul records them).
    "aten::resolve_conj", "aten::resolve_neg",
    # Views of a flat buffer made in one call (``torch._utils._unflatten_dense_tensors``:
    # a narrow and a view per tensor, nothing launched).
    "aten::unflatten_dense_tensors",
})
#: Leaf ops that make the host wait for the device when the tensor lives on CUDA.
HOST_SYNC_OPS = frozenset({
    "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::unique_dim",
    "aten::_unique2", "aten::_unique", "aten::equal",
})

ACCORDION = "accordion(steady=powersgd:rank=1,critical=powersgd:rank=4,eta=0.5,interval=10)"
#: The compressors of the many-workers target (extra ops at most 1.5x native DDP's), the
#: threshold in its fixed-capacity form (no host read).
MANY_WORKER_SPECS = ("topk:ratio=0.01", "randk:ratio=0.01", "qsgd:levels=16", "sign",
                     "threshold:lam=0.001,capacity=0.05")
#: name -> (kind, argument). kind: "local" (no DDP), "ddp" (no hook), "torch" (a PyTorch
#: hook), "gradzip" (a gradzip spec), "gradzip1" (a gradzip spec in one bucket, the
#: layout PyTorch's powerSGD_hook is counted in) or "gradzipf" (a gradzip spec with
#: ``fuse_buckets=True``: DDP's buckets as they are, averaged in one engine call per step).
SCHEMES: dict[str, tuple[str, str]] = {
    "local": ("local", ""),
    "ddp": ("ddp", ""),
    "torch-fp16": ("torch", "fp16"),
    "torch-powersgd:rank=4": ("torch", "powersgd"),  # in one bucket (see _build)
    "gradzip:none": ("gradzip", "none"),
    "gradzip:fp16": ("gradzip", "fp16"),
    "gradzip:bf16": ("gradzip", "bf16"),
    "gradzip:powersgd:rank=4": ("gradzip", "powersgd:rank=4"),
    "gradzip:powersgd:rank=1": ("gradzip", "powersgd:rank=1"),
    "gradzip-1bucket:powersgd:rank=4": ("gradzip1", "powersgd:rank=4"),
    "gradzip:topk:ratio=0.01": ("gradzip", "topk:ratio=0.01"),
    "gradzip:randk:ratio=0.01": ("gradzip", "randk:ratio=0.01"),
    "gradzip:qsgd:levels=16": ("gradzip", "qsgd:levels=16"),
    "gradzip:sign": ("gradzip", "sign"),
    "gradzip:threshold:lam=0.001": ("gradzip", "threshold:lam=0.001"),
    # The threshold's GPU form: a fixed capacity per tensor, no sizes read on the host.
    "gradzip:threshold:lam=0.001,capacity=0.05": ("gradzip", "threshold:lam=0.001,capacity=0.05"),
    f"gradzip:{ACCORDION}": ("gradzip", ACCORDION),
    **{f"gradzip-fused:{spec}": ("gradzipf", spec)
       for spec in ("none", "powersgd:rank=4", *MANY_WORKER_SPECS, ACCORDION)},
}
#: The targets: scheme -> (reference scheme, the largest allowed ratio of extra ops).
TARGETS: dict[str, tuple[str, float]] = {
    "gradzip:none": ("ddp", 1.2),
    "gradzip:bf16": ("ddp", 1.2),
    "gradzip:fp16": ("torch-fp16", 1.2),
    "gradzip:powersgd:rank=4": ("torch-powersgd:rank=4", 0.8),
    # Like for like: both in one bucket.
    "gradzip-1bucket:powersgd:rank=4": ("torch-powersgd:rank=4", 0.8),
    "gradzip:topk:ratio=0.01": ("ddp", 2.0),
    "gradzip:randk:ratio=0.01": ("ddp", 2.0),
    "gradzip:qsgd:levels=16": ("ddp", 2.0),
    "gradzip:sign": ("ddp", 2.0),
    # Accordion: against the larger of its levels' compressors alone.
    f"gradzip:{ACCORDION}": ("gradzip:powersgd:rank=4", 1.2),
    # The many-workers targets, with the step's buckets in one engine call (DDP's 4 buckets
    # unchanged): at most 1.5x native DDP's; PowerSGD at most PyTorch's hook's.
    **{f"gradzip-fused:{spec}": ("ddp", 1.5) for spec in MANY_WORKER_SPECS},
    "gradzip-fused:powersgd:rank=4": ("torch-powersgd:rank=4", 1.0),
    f"gradzip-fused:{ACCORDION}": ("gradzip-fused:powersgd:rank=4", 1.2),
}
#: Schemes allowed host syncs in steady state (the default threshold's exchanged sizes, not
#: its fixed-capacity form; Accordion's decisions).
SYNCS_ALLOWED = {"gradzip:threshold:lam=0.001", f"gradzip:{ACCORDION}",
                 f"gradzip-fused:{ACCORDION}"}


class SplitMatrices(nn.Module):
    """``tensors`` matrices of ``rows x cols`` applied to one input and summed: the same
    parameter bytes can be split over more, smaller tensors by changing the arguments."""

    def __init__(self, tensors: int, rows: int, cols: int) -> None:
        super().__init__()
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(rows, cols) / cols**0.5) for _ in range(tensors)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (batch, rows); every matrix gets a gradient of its full shape.
        return torch.stack([torch.tanh(x @ w).sum(1) for w in self.weights], 1)


def _one_kernel(name: str) -> bool:
    """Ops that CUDA runs as one kernel (a few for very large inputs) while the CPU runs them
    as child ops: a device-side assertion, and the multi-tensor ``_foreach_*`` ops (one
    launch per batch of tensors on CUDA, a loop of per-tensor ops on the CPU)."""
    return name == "aten::_assert_async" or name.startswith("aten::_foreach_")


def _inside_one_kernel(ev: Any) -> bool:
    """Whether ``ev`` is part of an op counted as one kernel (:func:`_one_kernel`)."""
    parent = ev.cpu_parent
    while parent is not None:
        if _one_kernel(parent.name):
            return True
        parent = parent.cpu_parent
    return False


def leaf_counts(events: Any) -> Counter[str]:
    """``op name -> count`` of the leaf ``aten::`` ops among profiler ``events`` (an op that
    CUDA runs as one kernel counts once, its CPU children not)."""
    counts: Counter[str] = Counter()
    for ev in events:
        if not ev.name.startswith(("aten::", "c10d::")):
            continue
        if ev.name.startswith("c10d::"):
            counts[ev.name] += 1
            continue
        # A composite op is counted through its children; children that launch nothing
        # (views, allocations, no-op resolutions) do not make their parent a composite.
        if not _one_kernel(ev.name) and any(
            child.name.startswith("aten::") and child.name not in NOT_COMPUTE
            for child in ev.cpu_children
        ):
            continue
        if _inside_one_kernel(ev):
            continue
        counts[ev.name] += 1
    return counts


def summarize(counts: Counter[str]) -> dict[str, int]:
    """ops (compute kernels), host syncs and collectives of one step's leaf counts."""
    ops = sum(n for k, n in counts.items()
              if k.startswith("aten::") and k not in NOT_COMPUTE and k not in HOST_SYNC_OPS)
    syncs = sum(n for k, n in counts.items() if k in HOST_SYNC_OPS)
    colls = sum(n for k, n in counts.items() if k.startswith("c10d::"))
    # A sync op is also a kernel (nonzero) or a copy (scalar read): count it among ops too.
    return {"ops": ops + syncs, "syncs": syncs, "collectives": colls}


def force_device_path(state: Any) -> None:
    """Make the gradzip hook's engine take the decision path CUDA tensors take (no host read
    of non-finite flags), so the CPU counts are those of a CUDA run."""
    state.engine.decide_on = "device"


def _bucket_cap_mb(model_fn: Callable[[], nn.Module], inputs: torch.Tensor, buckets: int) -> float:
    """A ``bucket_cap_mb`` that gives ``buckets`` buckets after DDP's rebuild (the nearest
    count found when none gives it exactly)."""
    total = sum(p.numel() * p.element_size() for p in model_fn().parameters()) / 2**20
    best = (buckets, total / buckets)
    for factor in (1.001, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 1.1, 1.2, 1.3):
        cap = total / buckets * factor
        ddp = DistributedDataParallel(model_fn().to(inputs.device), bucket_cap_mb=cap)
        for _ in range(2):  # the first backward rebuilds the buckets
            ddp(inputs).float().sum().backward()
        got = _bucket_count(ddp)
        if got == buckets:
            return cap
        if abs(got - buckets) < best[0]:
            best = (abs(got - buckets), cap)
    return best[1]


def _build(scheme: str, model: nn.Module, cap_mb: float,
           force_device: bool = True) -> tuple[nn.Module, Callable[[], int]]:
    """The model to train for ``scheme`` and a function giving its bucket count."""
    kind, arg = SCHEMES[scheme]
    if kind == "local":
        return model, lambda: 0
    if SCHEMES[scheme] == ("torch", "powersgd") or kind == "gradzip1":
        # One bucket: PyTorch's powerSGD_hook chains its all-reduces in future callbacks,
        # which can deadlock on gloo with two or more buckets (it hung here on the split
        # models); one bucket is also how its GPU figures are taken (gpu_step.py).
        cap_mb = 1e6
    ddp = DistributedDataParallel(model, bucket_cap_mb=cap_mb)
    if kind == "ddp":
        return ddp, lambda: _bucket_count(ddp)
    if kind == "torch":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        if arg == "fp16":
            inner, state = default_hooks.fp16_compress_hook, None
        else:
            inner = psgd.powerSGD_hook
            state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                       start_powerSGD_iter=2, random_seed=0)
        ddp.register_comm_hook(state, inner)
    else:
        register_hook(ddp, kind, arg, force_device)
    return ddp, lambda: _bucket_count(ddp)


def register_hook(ddp: DistributedDataParallel, kind: str, spec: str, force_device: bool = True,
                  **engine_options: Any) -> Any:
    """gradzip's hook on ``ddp`` as the schemes of ``kind`` (``gradzip``, ``gradzip1``,
    ``gradzipf``) set it up: inline (``overlap=False``), fused for ``gradzipf``, on the
    device decision path with ``force_device``; returns the hook's state."""
    hook_state = gradzip.ddp.register(ddp, spec, overlap=False, fuse_buckets=kind == "gradzipf",
                                      **engine_options)
    if force_device:
        force_device_path(hook_state)
    return hook_state


def _bucket_count(ddp: DistributedDataParallel) -> int:
    # The buckets of the last backward (DDP rebuilds them after the first iteration).
    return len(ddp.reducer._get_zeros_like_grad_buckets())


def count_scheme(scheme: str, model_fn: Callable[[], nn.Module], inputs: torch.Tensor,
                 cap_mb: float, steps: int, warmup: int, force_device: bool = True
                 ) -> dict[str, Any]:
    """Per-step counts of ``scheme`` over ``steps`` profiled steps after ``warmup`` ones."""
    torch.manual_seed(0)
    model = model_fn()
    trained, bucket_count = _build(scheme, model, cap_mb, force_device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        out = trained(inputs)
        out.float().pow(2).mean().backward()
        opt.step()

    per_step = []
    with device_forms() if force_device else contextlib.nullcontext():
        for _ in range(warmup):
            step()
        for _ in range(steps):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                step()
            counts = leaf_counts(prof.events())
            per_step.append((summarize(counts), counts))
    summaries = [s for s, _ in per_step]
    ops = [s["ops"] for s in summaries]
    merged: Counter[str] = Counter()
    for _, c in per_step:
        merged.update(c)
    return {
        "scheme": scheme,
        "ops_mean": statistics.fmean(ops), "ops_max": max(ops), "ops_min": min(ops),
        # PyTorch's powerSGD_hook runs part of each step in future callbacks on gloo's
        # thread, which the profiler sees in some steps only (its count varies from step to
        # step): its largest step is the one whose work was all seen. Every other scheme
        # counts the same in every step.
        "ops_counted": max(ops) if SCHEMES[scheme] == ("torch", "powersgd") else statistics.fmean(ops),
        "syncs_mean": statistics.fmean(s["syncs"] for s in summaries),
        "collectives_mean": statistics.fmean(s["collectives"] for s in summaries),
        "buckets": bucket_count(),
        "top_ops": {k: v / steps for k, v in merged.most_common(12)},
    }


def _init_group(backend: str = "gloo") -> None:
    if dist.is_initialized():
        return
    path = Path(tempfile.mkdtemp(prefix="gradzip-ops-")) / "store"
    dist.init_process_group(backend, init_method=f"file://{path}", rank=0, world_size=1)


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "resnet18": (lambda: build_model("resnet18", 10), lambda: torch.randn(2, 3, 32, 32)),
    # The same 2**18 parameters as 16 or as 64 tensors.
    "split16": (lambda: SplitMatrices(16, 128, 128), lambda: torch.randn(4, 128)),
    "split64": (lambda: SplitMatrices(64, 128, 32), lambda: torch.randn(4, 128)),
}


def run(models: list[str], schemes: list[str], buckets: int, steps: int, warmup: int,
        force_device: bool = True, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Count every scheme on every model; rows with ``extra_ops`` over the model's ``local``."""
    _init_group()
    rows = []
    for model_name in models:
        model_fn, input_fn = MODELS[model_name]
        torch.manual_seed(0)
        inputs = input_fn()
        cap_mb = _bucket_cap_mb(model_fn, inputs, buckets)
        base = None
        for scheme in ["local", *[s for s in schemes if s != "local"]]:
            row = count_scheme(scheme, model_fn, inputs, cap_mb, steps, warmup, force_device)
            row["model"] = model_name
            row["tensors"] = sum(1 for _ in model_fn().parameters())
            if scheme == "local":
                base = row["ops_counted"]
            row["extra_ops"] = row["ops_counted"] - base
            log(f"{model_name:9s} {scheme:40s} extra ops {row['extra_ops']:8.1f}  "
                f"syncs {row['syncs_mean']:5.1f}  buckets {row['buckets']}")
            rows.append(row)
    return rows


def verdicts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each target of the op counts, met or missed, from ``rows``."""
    out = []
    by = {(r["model"], r["scheme"]): r for r in rows}
    for (model, scheme), row in by.items():
        if model != "resnet18":
            continue
        if scheme in TARGETS and (model, TARGETS[scheme][0]) in by:
            ref, limit = TARGETS[scheme]
            ratio = row["extra_ops"] / max(by[(model, ref)]["extra_ops"], 1e-9)
            out.append({"target": f"{scheme} extra ops <= {limit}x {ref}'s",
                        "value": round(ratio, 3), "met": ratio <= limit})
        if scheme.startswith("gradzip"):
            allowed = scheme in SYNCS_ALLOWED
            syncs = row["syncs_mean"]
            if not allowed:
                out.append({"target": f"{scheme} host syncs per step == 0",
                            "value": syncs, "met": syncs == 0})
    # Native DDP itself copies each tensor into and out of its bucket (its own count grows with
    # the tensors), so this check is on the hook's own ops: the extra ops beyond native DDP's.
    for scheme in ("gradzip:none", "gradzip:powersgd:rank=4"):
        a, b = by.get(("split16", scheme)), by.get(("split64", scheme))
        da, db = by.get(("split16", "ddp")), by.get(("split64", "ddp"))
        if a and b and da and db:
            own_a, own_b = a["extra_ops"] - da["extra_ops"], b["extra_ops"] - db["extra_ops"]
            change = own_b / max(own_a, 1e-9) - 1
            out.append({"target": f"{scheme}: 4x the tensors, same bytes: hook's own ops "
                                  "change <= 10%",
                        "value": round(change, 3), "met": abs(change) <= 0.10})
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model (tensors) | scheme | extra ops/step | x native DDP | host syncs/step | "
             "collectives/step | buckets |", "|---|---|---:|---:|---:|---:|---:|"]
    ddp = {r["model"]: r["extra_ops"] for r in rows if r["scheme"] == "ddp"}
    for r in rows:
        if r["scheme"] == "local":
            continue
        ratio = r["extra_ops"] / ddp[r["model"]] if ddp.get(r["model"]) else float("nan")
        lines.append(f"| {r['model']} ({r['tensors']}) | `{r['scheme']}` | {r['extra_ops']:.0f} | "
                     f"{ratio:.2f} | {r['syncs_mean']:g} | {r['collectives_mean']:g} | "
                     f"{r['buckets']} |")
    return "\n".join(lines)


def verdict_table(found: list[dict[str, Any]]) -> str:
    lines = ["| target | measured | verdict |", "|---|---:|---|"]
    for v in found:
        lines.append(f"| {v['target']} | {v['value']:g} | {'met' if v['met'] else 'missed'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--buckets", type=int, default=4)
    parser.add_argument("--only", action="append", default=None, metavar="SCHEME",
                        help=f"count only these schemes (repeatable): {', '.join(SCHEMES)}")
    parser.add_argument("--models", default="resnet18,split16,split64",
                        help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--decide-on", choices=("device", "auto"), default="device",
                        help="device: gradzip takes the path CUDA tensors take (the default, "
                             "what a GPU run launches); auto: the path the CPU takes")
    args = parser.parse_args(argv)
    for name in args.only or []:
        if name not in SCHEMES:
            parser.error(f"--only must be one of {sorted(SCHEMES)}, got {name!r}")
    if args.steps < 1 or args.warmup < 0 or args.buckets < 1:
        parser.error("--steps and --buckets must be >= 1 and --warmup >= 0")
    torch.set_num_threads(1)
    schemes = args.only or list(SCHEMES)
    if "ddp" not in schemes:
        schemes = ["ddp", *schemes]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for name in models:
        if name not in MODELS:
            parser.error(f"--models must name models from {sorted(MODELS)}, got {name!r}")
    rows = run(models, schemes, args.buckets, args.steps, args.warmup,
               force_device=args.decide_on == "device")
    found = verdicts(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "gradzip": gradzip.__version__, "steps": args.steps,
            "decide_on": args.decide_on, "models": models,
            "warmup": args.warmup, "buckets": args.buckets, "command": " ".join(sys.argv)}
    (args.out / "op_counts.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "verdicts": found}, indent=1) + "\n")
    text = table(rows) + "\n\n" + verdict_table(found) + "\n"
    (args.out / "op_counts.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    raise SystemExit(main())
