"""PowerSGD on all matrices of a call together (same-shape matrices as one batch) against the
matrix-by-matrix reference: the same messages, averages, residuals and warm starts."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from gradzip import PowerSGD, SimulatedGroup
from gradzip.compressors.base import Job, StepContext
from gradzip.compressors.powersgd import _reduce_per_matrix, _tame
from gradzip.ops.lowrank import ALIGN_BYTES, stack_matrices

#: Shapes of one call: repeated conv kernels and matrices (batched), single ones, a matrix
#: sent dense (rate below 2) and vectors.
SHAPES = {
    "conv1": (16, 8, 3, 3), "conv2": (16, 8, 3, 3), "fc1": (24, 40), "conv3": (16, 8, 3, 3),
    "bias": (24,), "fc2": (24, 40), "big": (64, 96), "head": (6, 80), "scale": (7,),
}


#: Same-shape tensors next to one another: as views of one buffer, each group is a view
#: (every matrix, and each worker's row of the buffer, starts at a multiple of 64 bytes).
ADJACENT = {"a1": (16, 72), "a2": (16, 8, 9), "a3": (16, 72), "b": (16,), "c1": (24, 40),
            "c2": (24, 40)}


def _jobs(workers: int, gen: torch.Generator, flat: bool = False,
          shapes: dict[str, tuple[int, ...]] = SHAPES) -> list[Job]:
    """One job per shape with random gradients; with ``flat``, views of one ``[L, total]``
    buffer in order (as a bucket lays them out)."""
    sizes = [int(torch.Size(s).numel()) for s in shapes.values()]
    buffer = torch.randn(workers, sum(sizes), generator=gen)
    jobs, start = [], 0
    for (name, shape), n in zip(shapes.items(), sizes, strict=True):
        part = buffer[:, start:start + n].reshape(workers, *shape)
        jobs.append(Job(name, part if flat else part.clone()))
        start += n
    return jobs


def _run(reduce, comp: PowerSGD, workers: int, steps: int, flat: bool = False,  # noqa: ANN001, ANN202
         shapes: dict[str, tuple[int, ...]] = SHAPES):
    """``steps`` calls of ``reduce`` with warm starts carried over; every call's jobs and the
    state after each call."""
    gen = torch.Generator().manual_seed(7)
    state = comp.init_state({n: torch.Size(s) for n, s in shapes.items()})
    out = []
    for step in range(steps):
        jobs = _jobs(workers, gen, flat, shapes)
        reduce(jobs, state, SimulatedGroup(workers), StepContext(step, tuple(range(workers)), workers))
        out.append((jobs, {n: q.clone() for n, q in state["q"].items()}))
    return out


def _batched(comp: PowerSGD):  # noqa: ANN202
    return comp.reduce


def _reference(comp: PowerSGD):  # noqa: ANN202
    return lambda jobs, state, comm, ctx: _reduce_per_matrix(comp, jobs, state, comm, ctx)


def _assert_same(got, want, **tol: float) -> None:  # noqa: ANN001
    close = (lambda a, b: torch.allclose(a, b, **tol)) if tol else torch.equal
    for (jobs, q), (ref_jobs, ref_q) in zip(got, want, strict=True):
        assert q.keys() == ref_q.keys()
        for name in q:
            assert q[name].shape == ref_q[name].shape and close(q[name], ref_q[name]), name
        for job, ref in zip(jobs, ref_jobs, strict=True):
            assert close(job.averaged, ref.averaged), job.name
            assert close(job.own_decoded(), ref.own_decoded()), job.name
            assert close(job.leftover(), ref.leftover()), job.name


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("rank", [1, 2, 4])
def test_batched_equals_the_per_matrix_reference_bit_for_bit(workers: int, rank: int) -> None:
    """One power iteration, warm-started over three steps: every product of the batch is the
    2-D GEMM of the reference (same operands, same layout, one matrix per batch entry) and the
    orthogonalisation is QR matrix by matrix either way, so the results are identical."""
    comp = PowerSGD(matrix_rank=rank)
    _assert_same(_run(_batched(comp), comp, workers, 3), _run(_reference(comp), comp, workers, 3))


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize(
    "comp",
    [PowerSGD(matrix_rank=2, power_iterations=2), PowerSGD(matrix_rank=3, warm_start=False),
     PowerSGD(matrix_rank=1, min_compression_rate=1)],
)
def test_batched_equals_the_reference_for_other_options(comp: PowerSGD, flat: bool) -> None:
    """More iterations, fresh draws, smaller matrices compressed; gradients as views of one
    bucket-like buffer (the batch is then a view, not a copy). Still bit for bit."""
    got = _run(_batched(comp), comp, 2, 2, flat=flat)
    _assert_same(got, _run(_reference(comp), comp, 2, 2))


@pytest.mark.parametrize("workers", [1, 2])
def test_batches_viewed_in_place_equal_the_reference(workers: int) -> None:
    """Same-shape gradients next to one another in one buffer (a bucket's layout): each
    group is a view of the buffer, not a copy, and the results are still bit for bit."""
    comp = PowerSGD(matrix_rank=2)
    jobs = _jobs(workers, torch.Generator().manual_seed(0), True, ADJACENT)
    view = stack_matrices([j.tensor for j in jobs[:3]], 16, 72)
    assert view.data_ptr() == jobs[0].tensor.data_ptr()
    got = _run(_batched(comp), comp, workers, 2, flat=True, shapes=ADJACENT)
    _assert_same(got, _run(_reference(comp), comp, workers, 2, shapes=ADJACENT))


def test_warm_starts_are_reused_without_a_copy_and_stay_keyed_by_name() -> None:
    """After a call the stored ``Q`` of a group are ``[cols, r]`` views of one tensor, keyed by
    parameter name (the checkpoint format); the next call takes that tensor as it is, and
    the same state reloaded as separate tensors (an old checkpoint) gives the same result."""
    comp = PowerSGD(matrix_rank=2)
    first = _run(_batched(comp), comp, 1, 1)
    gen = torch.Generator().manual_seed(7)
    state = comp.init_state({n: torch.Size(s) for n, s in SHAPES.items()})
    comm, ctx = SimulatedGroup(1), StepContext(0, (0,), 1)
    comp.reduce(_jobs(1, gen), state, comm, ctx)
    convs = [state["q"][n] for n in ("conv1", "conv2", "conv3")]
    assert all(q.shape == (72, 2) for q in convs)
    assert convs[0]._base is not None and all(q._base is convs[0]._base for q in convs)
    assert torch.equal(convs[1], first[0][1]["conv2"])
    separate = {"q": {n: q.clone() for n, q in state["q"].items()}}
    jobs = _jobs(1, gen)
    again = [Job(j.name, j.tensor.clone()) for j in jobs]
    comp.reduce(jobs, state, comm, StepContext(1, (0,), 1))
    comp.reduce(again, separate, comm, StepContext(1, (0,), 1))
    for a, b in zip(jobs, again, strict=True):
        assert torch.equal(a.averaged, b.averaged), a.name
    for name in state["q"]:
        assert torch.equal(state["q"][name], separate["q"][name]), name


def test_taming_a_batch_scales_each_matrix_alone() -> None:
    """One huge warm start in a batch is scaled down; its neighbours are multiplied by 1."""
    q = torch.randn(3, 4, 10, generator=torch.Generator().manual_seed(3))
    q[1] *= 1e20
    tamed = _tame(q)
    for b in range(3):
        assert torch.equal(tamed[b], _tame(q[b])), b
    assert torch.equal(tamed[0], q[0]) and torch.equal(tamed[2], q[2])
    assert float(tamed[1].abs().max()) <= 1.0


def test_stack_matrices_views_aligned_consecutive_tensors_and_copies_others() -> None:
    """A view where every matrix already starts at a multiple of 64 bytes one step apart;
    otherwise (misplaced, shuffled, sizes that leave a neighbour misaligned) one copy into
    the aligned layout, each matrix contiguous at an aligned place."""
    buffer = torch.randn(2, 3 * 16 + 16)  # rows of 64 floats: every worker's row aligned
    parts = [buffer[:, 16 * i:16 * (i + 1)].reshape(2, 4, 2, 2) for i in range(3)]
    view = stack_matrices(parts, 4, 4)
    assert view.shape == (2, 3, 4, 4) and view.data_ptr() == buffer.data_ptr()
    for i, part in enumerate(parts):
        assert torch.equal(view[:, i], part.reshape(2, 4, 4))
    odd = torch.randn(2, 3 * 12 + 5)
    for tensors in ([odd[:, 12 * i:12 * (i + 1)].reshape(2, 3, 2, 2) for i in range(3)],
                    [parts[1].reshape(2, 4, 4), parts[0].reshape(2, 4, 4)],
                    [buffer[:, 1:17].reshape(2, 4, 4)]):
        rows, cols = tensors[0].shape[1], tensors[0][0].numel() // tensors[0].shape[1]
        copy = stack_matrices(tensors, rows, cols)
        assert copy.untyped_storage().data_ptr() not in (buffer.untyped_storage().data_ptr(),
                                                          odd.untyped_storage().data_ptr())
        for i, t in enumerate(tensors):
            assert torch.equal(copy[:, i], t.reshape(2, rows, cols))
            for w in range(2):
                assert copy[w, i].is_contiguous() and copy[w, i].data_ptr() % ALIGN_BYTES == 0
    with pytest.raises(ValueError, match="`tensors` must hold at least one tensor, got none"):
        stack_matrices([], 3, 4)
    with pytest.raises(ValueError, match=r"`tensors` must each hold 2 x 4 x 5 entries, got shape \(2, 4, 2, 2\)"):
        stack_matrices(parts, 4, 5)


def _ops_of_one_call(tensors: int, rows: int, cols: int) -> int:
    """Compute ops (leaf ATen ops that are not views) of one warm-started call of rank 4 over
    ``tensors`` matrices of one shape, gradients separate tensors."""
    comp = PowerSGD(matrix_rank=4)
    shapes = {f"w{i}": torch.Size([rows, cols]) for i in range(tensors)}
    state = comp.init_state(shapes)
    gen = torch.Generator().manual_seed(0)
    comm, ctx = SimulatedGroup(1), StepContext(0, (0,), 1)

    def call() -> None:
        jobs = [Job(n, torch.randn(1, rows, cols, generator=gen)) for n in shapes]
        comp.reduce(jobs, state, comm, ctx)
        for job in jobs:
            job.leftover()

    call()  # the warm starts of a previous call, as in steady state
    jobs = [Job(n, torch.randn(1, rows, cols, generator=gen)) for n in shapes]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        comp.reduce(jobs, state, comm, ctx)
        for job in jobs:
            job.leftover()
    views = {"aten::" + name for name in (
        "view", "reshape", "as_strided", "select", "slice", "unsqueeze", "transpose", "t",
        "expand", "split", "split_with_sizes", "empty", "empty_like", "empty_strided", "unbind",
        "alias", "_reshape_alias", "_unsafe_view", "squeeze", "result_type", "resize_",
        "contiguous", "detach", "item", "is_nonzero", "lift_fresh", "narrow")}

    def compute(ev) -> bool:  # noqa: ANN001
        return ev.name.startswith("aten::") and ev.name not in views

    # An op is counted when none of its children computes (a large ``cat`` may show a view
    # child, which must not hide it).
    return sum(1 for ev in prof.events()
               if compute(ev) and not any(compute(c) for c in ev.cpu_children))


def test_ops_of_a_call_grow_with_shapes_not_with_tensors() -> None:
    """The same bytes over 4x the tensors of one shape: the same number of ops (the old code
    ran several per matrix: a GEMM per worker, a copy and a rescale per warm start)."""
    assert _ops_of_one_call(16, 64, 64) == _ops_of_one_call(4, 64, 64)


@pytest.mark.parametrize("workers", [1, 3])
def test_a_call_without_matrices_is_one_all_reduce_in_both_forms(workers: int) -> None:
    """Every tensor below the compression threshold: the batched form and the reference both
    send the dense tensors' message alone (no second, empty all-reduce), with the same bits."""
    comp = PowerSGD(matrix_rank=4)
    shapes = {"b": (16,), "s": (3, 2), "t": (2, 2, 2)}
    calls = []
    for reduce in (_batched(comp), _reference(comp)):
        gen = torch.Generator().manual_seed(3)
        state = comp.init_state({n: torch.Size(s) for n, s in shapes.items()})
        comm = SimulatedGroup(workers)
        jobs = _jobs(workers, gen, shapes=shapes)
        reduce(jobs, state, comm, StepContext(0, tuple(range(workers)), workers))
        calls.append((comm.meter.calls, [j.averaged for j in jobs]))
    (got_calls, got), (want_calls, want) = calls
    assert got_calls == want_calls == 1
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
