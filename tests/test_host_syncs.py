"""Steady steps on the device decision path make no host read of a device value, and the
per-bucket compressors' device work does not grow with the number of tensors.

On CUDA a scalar read (``.item()``, ``bool()``, ``int()``) or a ``nonzero`` stalls the stream
that launches kernels. Here the path CUDA tensors take is forced on the CPU
(``decide_on="device"``) and the ops of steady steps are recorded: every host-reading op must
sit inside a device-side assertion (``torch._assert_async``, which on CUDA reads nothing).
"""

from __future__ import annotations

import pytest
import torch

import gradzip
from conformance import SHAPES, make_grads
from gradzip.comm.simulated import SimulatedGroup
from gradzip.compressors import threshold as threshold_module
from gradzip.compressors import threshold_sized
from gradzip.compressors.base import Job, StepContext
from gradzip.ops.branches import device_forms
from gradzip.ops.checks import check_on_device, check_range
from gradzip.spec import compressor_from_spec

#: Ops that read a device value on the host (on CUDA).
READS_HOST = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
              "aten::_unique2", "aten::unique_dim", "aten::equal"}


def _host_reads(events: list) -> list[str]:
    """The host-reading ops among ``events`` that are not part of a device-side assertion."""
    found = []
    for ev in events:
        if ev.name not in READS_HOST:
            continue
        parent, inside = ev.cpu_parent, False
        while parent is not None:
            inside = inside or parent.name == "aten::_assert_async"
            parent = parent.cpu_parent
        if not inside:
            found.append(ev.name)
    return found


@pytest.mark.parametrize("spec", ["topk:ratio=0.05", "randk:ratio=0.05", "qsgd:levels=4", "sign",
                                  "threshold:lam=0.5,capacity=0.05"])
def test_steady_steps_read_nothing_on_the_host(spec: str) -> None:
    engine = gradzip.Engine(SHAPES, spec, collective=SimulatedGroup(2), decide_on="device")
    for step in range(2):  # the first step records the residuals (steady state after it)
        engine.reduce(make_grads(2, step))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.reduce(make_grads(2, 2))
    assert engine._skips.pending is not None  # the device path was really taken
    assert _host_reads(prof.events()) == []


def test_range_check_raises_a_precise_value_error_on_the_cpu() -> None:
    check_range(torch.tensor([0, 3, 16], dtype=torch.uint8), 16, "message codes")
    check_range(torch.zeros(0, dtype=torch.int64), 0, "message codes")
    with pytest.raises(ValueError, match=r"^message codes must lie in \[0, 16\], got 17$"):
        check_range(torch.tensor([[0, 17, 3]]), 16, "message codes")
    with pytest.raises(ValueError, match=r"^message indices must lie in \[0, 4\], got -2$"):
        check_range(torch.tensor([-2, 9]), 4, "message indices")
    with pytest.raises(ValueError, match="^fallback$"):
        check_on_device(torch.tensor(False), "fallback")
    check_on_device(torch.tensor(True), "never raised", lambda: "never raised")



def _ops_of_one_call(spec: str, tensors: int, names: set[str]) -> int:
    """How many ops among ``names`` one call of ``spec`` runs over ``tensors`` tensors of
    8192 entries in total (two simulated workers)."""
    comp = compressor_from_spec(spec)
    gen = torch.Generator().manual_seed(tensors)
    jobs = [Job(f"t{i}", torch.randn(2, 8192 // tensors, generator=gen)) for i in range(tensors)]
    state = comp.init_state({job.name: job.tensor.shape[1:] for job in jobs})
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        comp.reduce(jobs, state, SimulatedGroup(2), StepContext(3, (0, 1), 2))
    assert all(job.averaged is not None for job in jobs)
    return sum(1 for ev in prof.events() if ev.name in names)


# The ops that touch the tensors' entries on the device (per tensor before the work was
# done per call): they must not multiply with the number of tensors.
PER_CALL = {
    "randk:ratio=0.05": {"aten::index_copy_"},  # (its index draws are host work)
    # (tensors of one size: one selection for all)
    "topk:ratio=0.05": {"aten::topk", "aten::index_fill_", "aten::scatter_", "aten::index_add_"},
    "sign": {"aten::abs", "aten::mean", "aten::ge", "aten::isfinite", "aten::addcmul_",
             "aten::index_select"},
}


@pytest.mark.parametrize("spec", sorted(PER_CALL))
def test_work_per_call_does_not_grow_with_the_number_of_tensors(spec: str) -> None:
    few = _ops_of_one_call(spec, 2, PER_CALL[spec])
    many = _ops_of_one_call(spec, 32, PER_CALL[spec])
    assert 0 < few and many == few, (few, many)


def _threshold_run(spec: str, workers: int, monkeypatch: pytest.MonkeyPatch, per_call: bool) -> list:
    monkeypatch.setattr(threshold_sized, "_selects_per_call", lambda device: per_call)
    engine = gradzip.Engine(SHAPES, spec, collective=SimulatedGroup(workers))
    out = []
    for step in range(4):
        grads = make_grads(workers, step)
        if step == 2:  # a NaN never reaches lambda; the step is skipped either way
            grads["fc.weight"].view(workers, -1)[0, 3] = float("nan")
        out.append(engine.reduce(grads))
    return [out, engine.state_dict()["residuals"], engine.stats]


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("spec", ["threshold:lam=1.5", "threshold:budget=0.05",
                                  "threshold:budget=0.05,padded=True"])
def test_threshold_selection_per_call_equals_the_per_tensor_scan(
    spec: str, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off the CPU the sized form selects every tensor of a call at once (one host
    read per call); forced here, it gives the CPU scan's averages, residuals and counts bit for bit."""
    scan = _threshold_run(spec, workers, monkeypatch, per_call=False)
    batched = _threshold_run(spec, workers, monkeypatch, per_call=True)
    for a, b in zip(scan[0], batched[0], strict=True):
        assert all(torch.equal(a[n].nan_to_num(7.0), b[n].nan_to_num(7.0)) for n in a)
    assert scan[1].keys() == batched[1].keys()
    assert all(torch.equal(scan[1][n], batched[1][n]) for n in scan[1])
    assert scan[2] == batched[2]


def test_threshold_selection_per_call_reads_the_host_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threshold_sized, "_selects_per_call", lambda device: True)
    comp = compressor_from_spec("threshold:budget=0.05,exchange=allgather")
    gen = torch.Generator().manual_seed(0)
    jobs = [Job(f"t{i}", torch.randn(2, 300, generator=gen)) for i in range(12)]
    state = comp.init_state({job.name: job.tensor.shape[1:] for job in jobs})
    state["lam"] = 0.5  # calibrated already (the first step's one read)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        threshold_module.HardThreshold.reduce(comp, jobs, state, SimulatedGroup(2),
                                              StepContext(0, (0, 1), 2))
    assert _host_reads(prof.events()) == []  # the counts' read is a .tolist(): no op shows
    assert sum(ev.name == "aten::nonzero_static" for ev in prof.events()) == 1


def _all_ops_of_one_call(spec: str, sizes: list[int]) -> int:
    """Every compute op one call of ``spec`` runs over tensors of ``sizes`` (two simulated
    workers), in the forms a GPU takes."""
    comp = compressor_from_spec(spec)
    gen = torch.Generator().manual_seed(len(sizes))
    jobs = [Job(f"t{i}", torch.randn(2, n, generator=gen)) for i, n in enumerate(sizes)]
    state = comp.init_state({job.name: job.tensor.shape[1:] for job in jobs})
    with device_forms():  # the steady state: the layout's shape-only tensors built once
        comp.reduce([Job(j.name, j.tensor.clone()) for j in jobs], dict(state), SimulatedGroup(2),
                    StepContext(2, (0, 1), 2))
    with device_forms(), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        comp.reduce(jobs, state, SimulatedGroup(2), StepContext(3, (0, 1), 2))
    assert all(job.averaged is not None and job.residual is not None for job in jobs)
    return sum(1 for ev in prof.events()
               if ev.name.startswith("aten::") and ev.name not in _NO_KERNEL
               and not any(child.name.startswith("aten::") and child.name not in _NO_KERNEL
                           for child in ev.cpu_children))


#: Leaf ops that launch no kernel (views, allocations, metadata).
_NO_KERNEL = {"aten::view", "aten::_unsafe_view", "aten::as_strided", "aten::reshape",
              "aten::_reshape_alias", "aten::slice", "aten::select", "aten::narrow",
              "aten::unsqueeze", "aten::squeeze", "aten::alias", "aten::detach", "aten::empty",
              "aten::empty_like", "aten::empty_strided", "aten::lift_fresh", "aten::expand",
              "aten::split", "aten::split_with_sizes", "aten::result_type", "aten::t",
              "aten::transpose", "aten::unbind", "aten::resize_", "aten::item"}


@pytest.mark.parametrize("spec", ["topk:ratio=0.05,exchange=allgather", "randk:ratio=0.05",
                                  "threshold:lam=0.5,capacity=0.05,exchange=allgather"])
def test_sparsifier_ops_do_not_grow_with_tensors_of_many_sizes(spec: str) -> None:
    """One whole-message selection per call: the ops are the same for 3 tensors of 3 sizes
    as for 24 tensors of 24 sizes (per tensor or per size before)."""
    few = _all_ops_of_one_call(spec, [600, 700, 800])
    many = _all_ops_of_one_call(spec, [600 + 40 * i for i in range(24)])
    assert 0 < few and many == few, (few, many)
