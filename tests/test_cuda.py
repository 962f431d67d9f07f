"""CUDA behaviour: no host synchronisation in steady state, and the same results as the CPU.

Skipped without a CUDA device. ``benchmarks/gpu_check.sh`` runs this file on a GPU machine.

* All-reduce-only compressors (``none``, ``fp16``, ``bf16``, ``randk``, ``powersgd``) and the
  gathering ones that decide on the device (``topk``, ``qsgd``, ``sign``) must not make the
  host wait for the GPU once their state lives on the device: a wait stalls the
  stream that launches kernels (in a DDP hook, once per bucket). Checked with
  ``torch.cuda.set_sync_debug_mode("error")``, which turns every synchronising call
  (``.item()``, ``.tolist()``, ``nonzero``, a copy to or from pageable host memory) into an
  error, both on the compressor alone and through the :class:`~gradzip.Engine`.
* Every compressor, the sparse ones whose CPU paths go through NumPy included, computes on CUDA
  what it computes on the CPU from the same inputs (to float rounding).
* A DDP bucket of a compressor with a segment form takes the segment path on CUDA
  (``gradzip.engine.segments``), issues no host synchronisation in steady state, and leaves
  what the host path leaves, bit for bit (``tests/test_segments_single.py`` on the CPU).
* The DDP hook trains a CUDA model with every scheme ``benchmarks/host_time.py`` times, per
  bucket and fused, and a NaN step is rolled back and handed on as NaN (one NCCL rank).
* HSDP on a 1 x 1 CUDA mesh (one NCCL rank): the exchange across replicas makes no host
  synchronisation in steady state, and a NaN step is skipped.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import test_accordion_segments as accordion_rows
import test_segments_single as single_bucket
from gradzip import Engine
from gradzip.comm.simulated import SimulatedGroup, SingleWorker
from gradzip.compressors.base import Job, StepContext
from gradzip.ops.select import _topk_narrowed, topk_abs
from gradzip.spec import compressor_from_spec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# A conv kernel, a linear layer large enough for Top-k's sampled cut (>= 65536 entries) and
# the threshold's folded search, a small matrix PowerSGD sends dense, and a bias.
SHAPES = {
    "conv.weight": torch.Size((64, 32, 3, 3)),
    "fc.weight": torch.Size((256, 512)),
    "head.weight": torch.Size((10, 8)),
    "fc.bias": torch.Size((256,)),
}

ALLREDUCE_ONLY = [
    "none",
    "fp16",
    "bf16",
    "randk:ratio=0.01",
    "randk:ratio=0.5",  # the dense (randperm) draw
    "powersgd:rank=4",
    "powersgd:rank=1",  # the normalisation path instead of QR
    "powersgd:rank=2,warm_start=False",  # a fresh Q from the host every step
]

# Compressors that all-gather, and decide on the device too: their received indices and codes
# are checked by device-side assertions, their sizes come from the shapes.
GATHERING = [
    "topk:ratio=0.01",
    "topk:ratio=0.3",  # dense where sparse does not pay
    "qsgd:levels=16",
    "qsgd:levels=4,bucket_size=512",
    "sign",
    # The sharded exchange (forced: at two workers the all-gather is cheaper), owner
    # residuals made on the host and moved at the first call.
    "qsgd:levels=16,exchange=sharded",
    "sign:exchange=sharded",
    # The sparse sharded exchange: fixed-capacity parts to each owner, no size read on the host.
    "topk:ratio=0.01,exchange=sharded",
    # The hard threshold with a capacity: its message size comes from the shapes, what
    # overflows the capacity stays in the residual, and its counters live on the device.
    "threshold:lam=0.05,capacity=0.1",
]
NO_HOST_SYNC = ALLREDUCE_ONLY + GATHERING

ACCORDION = "accordion(steady=powersgd:rank=1,critical=powersgd:rank=4,interval=2)"


def _grads(step: int, workers: int | None) -> dict[str, torch.Tensor]:
    """Seeded CPU gradients (with a worker axis when ``workers`` is given)."""
    gen = torch.Generator().manual_seed(1000 + step)
    lead = () if workers is None else (workers,)
    return {n: torch.randn(*lead, *s, generator=gen) for n, s in SHAPES.items()}


def _on(grads: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    return {n: g.to(device) for n, g in grads.items()}


def _collective(workers: int | None) -> SingleWorker | SimulatedGroup:
    return SingleWorker() if workers is None else SimulatedGroup(workers)


class _SyncsAreErrors:
    """``torch.cuda.set_sync_debug_mode("error")`` for the ``with`` block."""

    def __enter__(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


def test_sync_debug_mode_catches_a_host_sync() -> None:
    # The tests below mean something only if the mode really turns a sync into an error.
    x = torch.ones(3, device="cuda")
    with pytest.raises(RuntimeError, match="synchroniz"), _SyncsAreErrors():
        x.sum().item()
    with pytest.raises(RuntimeError, match="synchroniz"), _SyncsAreErrors():
        torch.arange(4).to("cuda")  # pageable host memory: copy, then wait


@pytest.mark.parametrize("workers", [None, 2], ids=["single", "simulated2"])
@pytest.mark.parametrize("spec", NO_HOST_SYNC)
def test_compressor_reduce_issues_no_host_sync(spec: str, workers: int | None) -> None:
    compressor = compressor_from_spec(spec)
    comm = _collective(workers)
    state = compressor.init_state(SHAPES)
    lead = workers or 1
    for step in range(5):
        # Steps 0-1 move host-made state (PowerSGD's first Q) to the device; then steady state.
        grads = _on(_grads(step, lead), "cuda")
        ctx = StepContext(step=step, ranks=tuple(comm.local_ranks), world_size=comm.world_size)
        jobs = [Job(n, g) for n, g in grads.items()]
        compressor.begin_step(state, comm, ctx)
        if step >= 2:
            with _SyncsAreErrors():
                compressor.reduce(jobs, state, comm, ctx)
                leftovers = [job.leftover() for job in jobs]
                compressor.end_step(state, ctx)
        else:
            compressor.reduce(jobs, state, comm, ctx)
            leftovers = [job.leftover() for job in jobs]
            compressor.end_step(state, ctx)
        for job, rest in zip(jobs, leftovers, strict=True):
            assert job.averaged is not None and job.averaged.device.type == "cuda"
            assert rest.shape == job.tensor.shape


@pytest.mark.parametrize("workers", [None, 2], ids=["single", "simulated2"])
@pytest.mark.parametrize("spec", NO_HOST_SYNC)
def test_engine_reduce_issues_no_host_sync(spec: str, workers: int | None) -> None:
    """Through the engine (error feedback, the non-finite agreement, state snapshots)."""
    engine = Engine(dict(SHAPES), spec, collective=_collective(workers))
    for step in range(5):
        grads = _on(_grads(step, workers), "cuda")
        if step >= 2:
            with _SyncsAreErrors():
                out = engine.reduce(grads)
        else:
            out = engine.reduce(grads)
        assert set(out) == set(SHAPES)
        assert all(v.device.type == "cuda" for v in out.values())
    assert engine.stats["skipped_steps"] == 0


def test_topk_selection_issues_no_host_sync_and_keeps_the_exact_top_k() -> None:
    # Rows large enough that the CPU would take the sampled-cut path; on CUDA torch.topk runs
    # directly and the host never waits. Same set of entries as the narrowing path.
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 300_000, generator=gen).to("cuda")
    k = 3_000
    with _SyncsAreErrors():
        values, idx = topk_abs(x, k)
    ref_values, ref_idx = _topk_narrowed(x, k)
    for row in range(2):
        assert set(idx[row].tolist()) == set(ref_idx[row].tolist())
        torch.testing.assert_close(values[row], x[row, idx[row]], rtol=0, atol=0)
        assert float(values[row].abs().min()) >= float(x[row].abs().kthvalue(300_000 - k + 1).values)


# (spec, tolerance relative to the largest magnitude): deterministic compressors must match
# at every entry; PowerSGD to the rounding of matmuls and QR, which differ between BLAS and
# cuBLAS; ``None`` marks the stochastic quantiser, which may round an entry to the other level
# where its noise sits within float rounding of the cut (a tiny fraction of entries). fp16 and
# bf16 divide by the world size before the cast, and CUDA divides by a scalar as a multiply by
# its reciprocal: one fp32 ulp apart, which can move a value to the neighbouring half-precision
# number (a relative step of 2**-10 for fp16, 2**-7 for bf16).
CORRECTNESS = [
    ("none", 1e-6),
    ("fp16", 2.0**-10),
    ("bf16", 2.0**-7),
    ("randk:ratio=0.05", 1e-6),
    ("powersgd:rank=2", 1e-3),
    ("powersgd:rank=1", 1e-3),
    ("topk:ratio=0.01", 1e-6),
    ("topk:ratio=0.3", 1e-6),  # dense fallback: k too large for the all-gather to pay
    ("threshold:lam=1.5", 1e-6),
    ("sign", 1e-5),
    ("qsgd:levels=8", None),
    ("qsgd:levels=4,bucket_size=512", None),
    (ACCORDION, 1e-3),
]


def _close(gpu: torch.Tensor, cpu: torch.Tensor, tol: float | None, what: str) -> None:
    scale = float(cpu.abs().max()) + 1e-12
    diff = (gpu - cpu).abs()
    if tol is None:
        off = float((diff > 1e-4 * scale).float().mean())
        assert off <= 1e-3, f"{what}: {off:.3%} of entries differ"
    else:
        worst = float(diff.max())
        assert worst <= tol * scale, f"{what}: differs by {worst:.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("workers", [None, 3], ids=["single", "simulated3"])
@pytest.mark.parametrize(("spec", "tol"), CORRECTNESS, ids=[c[0] for c in CORRECTNESS])
def test_cuda_matches_cpu(spec: str, tol: float | None, workers: int | None) -> None:
    engines = {d: Engine(dict(SHAPES), spec, collective=_collective(workers)) for d in ("cpu", "cuda")}
    for step in range(4):  # error feedback and warm starts carry state across steps
        grads = _grads(step, workers)
        out = {d: engines[d].reduce(_on(grads, d)) for d in engines}
        for name in SHAPES:
            cpu, gpu = out["cpu"][name], out["cuda"][name]
            assert gpu.device.type == "cuda"
            assert gpu.dtype == cpu.dtype and gpu.shape == cpu.shape
            _close(gpu.cpu(), cpu, tol, f"{name} at step {step}")
    for d in engines:
        assert engines[d].stats["skipped_steps"] == 0
    assert engines["cpu"].stats["payload_bytes"] == engines["cuda"].stats["payload_bytes"]
    # The residuals (error feedback) agree too.
    assert set(engines["cpu"].residuals) == set(engines["cuda"].residuals)
    for name, rest in engines["cpu"].residuals.items():
        _close(engines["cuda"].residuals[name].cpu(), rest, tol, f"residual of {name}")


@pytest.mark.parametrize("spec", single_bucket.SPECS)
def test_the_segment_path_on_cuda_never_syncs_and_equals_the_host_path(spec: str) -> None:
    got = single_bucket.run(spec, "auto", device="cuda", steady=_SyncsAreErrors())
    want = single_bucket.run(spec, "host", device="cuda")
    assert got["segments"] >= 4 and not want["segments"]
    assert single_bucket.same(got, want)


@pytest.mark.parametrize("spec", accordion_rows.SPECS[:2])
def test_accordion_rows_on_cuda_equal_the_ordinary_call_across_decisions(
    spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    got = accordion_rows.run(spec, "device", device="cuda")
    want = accordion_rows.ordinary(spec, monkeypatch, device="cuda")
    assert got["segment_calls"] > 0 and want["segment_calls"] == 0
    assert accordion_rows.equal(got["averages"], want["averages"])
    assert accordion_rows.equal(got["state"], want["state"])
    assert got["stats"] == want["stats"] and got["error"] == want["error"]


def test_where_many_brings_old_values_from_both_devices() -> None:
    # State made on the host moves to the GPU piece by piece; a rollback may decide new values
    # laid out in one GPU buffer whose old values are partly still on the host.
    from gradzip.engine.deferred import where_many

    before = [torch.tensor([1.0, 2.0]), torch.tensor([3.0], device="cuda")]
    buffer = torch.tensor([10.0, 20.0, 30.0], device="cuda")
    after = [buffer[:2], buffer[2:]]
    for flag, want in ((True, [[1.0, 2.0], [3.0]]), (False, [[10.0, 20.0], [30.0]])):
        got = where_many(torch.tensor(flag, device="cuda"), before, after)
        assert [g.device.type for g in got] == ["cuda", "cuda"]
        assert [g.tolist() for g in got] == want


# Every gradzip scheme benchmarks/host_time.py times, as a DDP hook on a CUDA model: per bucket
# (inline) and fused, through the engine's device path and each compressor's state as it moves
# from the host (where it is made) to the GPU (where it is used).
DDP_SPECS = ["none", "fp16", "powersgd:rank=4", "topk:ratio=0.01", "randk:ratio=0.01",
             "qsgd:levels=16", "sign", "threshold:lam=0.001",
             "threshold:lam=0.001,capacity=0.05", ACCORDION]


def train_ddp(spec: str, device: str, *, fused: bool, steps: int = 5) -> torch.nn.Module:
    """A width-4 ResNet-18 in several DDP buckets with gradzip's hook for ``spec``, trained
    ``steps`` steps on ``device`` (a process group must be up). The gradients of the step
    before the last are NaN: the hook must roll its state back and hand back NaN buckets, and
    the step is skipped as a ``GradScaler`` would skip it; the last step must train again.
    Returns the model."""
    from torch.nn.parallel import DistributedDataParallel

    import gradzip
    from gradzip.train.models import build_model

    torch.manual_seed(0)
    model = build_model("resnet18", 10, width=4).to(device)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.05)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    state = gradzip.ddp.register(ddp, spec, overlap=False, fuse_buckets=fused, optimizer=opt)
    inputs = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0)).to(device)
    for step in range(steps):
        poisoned = step == steps - 2
        opt.zero_grad()
        loss = ddp(inputs).float().pow(2).mean()
        (loss * float("nan") if poisoned else loss).backward()
        finite = all(torch.isfinite(p.grad).all() for p in model.parameters())
        assert finite != poisoned, (spec, step)
        if finite:
            opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters()), spec
    assert state.stats["skipped_steps"] == 1, spec
    return model


@pytest.fixture(scope="module")
def nccl_group(tmp_path_factory: pytest.TempPathFactory):
    import torch.distributed as dist

    store = tmp_path_factory.mktemp("nccl") / "store"
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("fused", [False, True], ids=["per-bucket", "fused"])
@pytest.mark.parametrize("spec", DDP_SPECS)
def test_ddp_hook_trains_on_cuda_and_skips_a_nan_step(spec: str, fused: bool,
                                                      nccl_group: None) -> None:
    train_ddp(spec, "cuda", fused=fused)


def train_fsdp(spec: str, device: str, steady: Any) -> Any:
    """A small MLP under HSDP on a 1 x 1 mesh of ``device`` (a process group of one rank must
    be up), gradzip's exchange across replicas for ``spec``: 3 finite steps, the third with
    each exchange inside ``steady`` (a context manager, e.g. syncs as errors), then a step
    whose gradients hold a NaN (skipped by the policy) and a finite one. Returns the hook's
    state."""
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp_nets
    import gradzip

    mesh = init_device_mesh(device, (1, 1), mesh_dim_names=("replicate", "shard"))
    model = fsdp_nets.sharded(mesh["shard"])
    state = gradzip.fsdp.register(model, spec, mesh=mesh, nonfinite="skip")
    exchange = state.exchange

    def guarded(layout: Any, flat: torch.Tensor) -> None:
        with steady:
            exchange(layout, flat)

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(5):
        x, y = fsdp_nets.batch(step, 0)
        x, y = x.to(device), y.to(device)
        if step == 3:
            x[:, 0] = float("nan")  # reaches the scale's gradient only (see fsdp_nets.Net)
        if step == 2:
            state.exchange = guarded  # the hooks look the method up on the state
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        state.exchange = exchange
        grads = [p.grad.to_local() for p in model.parameters()]
        assert all(g.device.type == torch.device(device).type for g in grads)
        if step == 3:
            assert bool(model.scale.grad.to_local().isnan().all()), spec
        else:
            assert all(bool(g.isfinite().all()) for g in grads), (spec, step)
            opt.step()
    assert state.stats["skipped_steps"] == 1, spec
    assert state.stats["steps"] == 5, spec
    return state


@pytest.mark.parametrize("spec", ["none", "powersgd:rank=2", "topk:ratio=0.2", "qsgd:levels=16",
                                  "sign", "randk:ratio=0.2"])
def test_hsdp_exchange_on_cuda_never_syncs_and_skips_a_nan_step(spec: str,
                                                                 nccl_group: None) -> None:
    train_fsdp(spec, "cuda", steady=_SyncsAreErrors())
