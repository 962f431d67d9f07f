"""One conformance suite over every compressor, in a simulated group."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import gradzip
from conformance import DECODE_TOL, SHAPES, SPECS, make_grads
from gradzip.comm.base import allreduce_wire_bytes
from gradzip.comm.header import HEADER_BYTES
from gradzip.compressors.base import Job, StepContext
from gradzip.compressors.sharded_sparse import exchange_forms
from gradzip.feedback import residual_after
from gradzip.spec import CONTROLLERS, REGISTRY
from gradzip.statecheck import copy_tree


def test_every_registered_compressor_and_controller_is_covered() -> None:
    names = {gradzip.compressor_from_spec(s).spec_name for s in SPECS}
    assert names == set(REGISTRY) | set(CONTROLLERS)


def sharded_forms(compressor: object, workers: int) -> dict[str, str]:
    """The exchange form of each tensor of SHAPES, for a sparsifier that has them, else {}."""
    if not hasattr(compressor, "exchange_for"):
        return {}
    return exchange_forms(compressor, SHAPES, workers)


def engine_for(spec: str, workers: int = 4) -> gradzip.Engine:
    return gradzip.Engine(SHAPES, spec, collective=gradzip.SimulatedGroup(workers))


def run(engine: gradzip.Engine, steps: range, workers: int = 4) -> list[dict[str, torch.Tensor]]:
    return [engine.reduce(make_grads(workers, s)) for s in steps]


@pytest.mark.parametrize("spec", SPECS)
def test_shape_dtype_device_kept_and_inputs_untouched(spec: str) -> None:
    engine = engine_for(spec)
    for dtype in (torch.float32, torch.bfloat16):
        grads = {n: g.to(dtype) for n, g in make_grads(4, 0).items()}
        before = {n: g.clone() for n, g in grads.items()}
        out = engine.reduce(grads)
        assert set(out) == set(SHAPES)
        for name, shape in SHAPES.items():
            assert out[name].shape == shape
            assert out[name].dtype == dtype
            assert out[name].device == grads[name].device
            assert torch.isfinite(out[name]).all()
            assert torch.equal(grads[name], before[name])


@pytest.mark.parametrize("spec", [s for s in SPECS if s != "none"])
def test_sends_fewer_bytes_than_dense(spec: str) -> None:
    engine = engine_for(spec)
    run(engine, range(3))
    stats = engine.stats
    for w in range(4):
        assert 0 < stats["payload_bytes"][w] < stats["dense_payload_bytes"][w]
        assert 0 < stats["wire_bytes"][w] < stats["dense_wire_bytes"][w]


def test_none_sends_exactly_dense_bytes() -> None:
    engine = engine_for("none")
    out = run(engine, range(2))[-1]
    stats = engine.stats
    # Dense bytes, plus the fixed-size header of each call (two calls here).
    header, header_wire = 2 * HEADER_BYTES, 2 * allreduce_wire_bytes(HEADER_BYTES, 4)
    assert [p - header for p in stats["payload_bytes"]] == stats["dense_payload_bytes"]
    assert [w - header_wire for w in stats["wire_bytes"]] == stats["dense_wire_bytes"]
    grads = make_grads(4, 1)
    for name in SHAPES:
        assert torch.allclose(out[name], grads[name].mean(0), atol=1e-6)


@pytest.mark.parametrize("spec", SPECS)
def test_average_of_decoded_messages_is_the_result(spec: str) -> None:
    """What each worker's message decodes to, averaged, is what every worker receives; and
    error feedback keeps exactly the difference."""
    compressor = gradzip.compressor_from_spec(spec)
    comm = gradzip.SimulatedGroup(4)
    state = compressor.init_group_state(SHAPES, 4, 4)
    tol = DECODE_TOL.get(spec, 1e-5)
    for step in range(2):  # the second step starts from owner residuals left by the first
        owners = dict(state.get("owner", {}))
        grads = make_grads(4, step)
        jobs = [Job(n, g.clone()) for n, g in grads.items()]
        compressor.reduce(jobs, state, comm,
                          StepContext(step=step, ranks=(0, 1, 2, 3), world_size=4))
        for job in jobs:
            assert job.averaged is not None
            decoded, residual = job.own_decoded(), job.leftover()
            assert decoded.shape == residual.shape == job.tensor.shape
            # The messages each worker sent, decoded by the receivers and averaged, against
            # what the worker itself says it sent (its decoded message, or its tensor minus
            # the residual it keeps): two independent paths. Where a part's owner encodes
            # the average again (the sharded exchange), what its owner residual gained is
            # what the re-encoding held back.
            assert torch.allclose(decoded + residual, job.tensor, atol=1e-6)
            want = decoded.mean(0)
            if job.name in state.get("owner", {}):
                held = owners[job.name] - state["owner"][job.name]  # [4 owners, c]
                want = want + held.reshape(-1)[: job.numel].reshape(job.shape)
            elif state.get("forms", {}).get(job.name) == "sharded":
                # QSGD, the one sharded code without an owner residual (it is unbiased):
                # the owner rounds each entry of its part's mean to a neighbouring level,
                # within one step (the part's norm / levels) of it.
                c = -(-job.numel // 4)
                parts = torch.nn.functional.pad(want.reshape(-1), (0, 4 * c - job.numel))
                level_step = parts.reshape(4, c).norm(dim=1, keepdim=True) / compressor.levels
                gap = (job.averaged.reshape(-1) - want.reshape(-1)).abs()
                bound = level_step.expand(4, c).reshape(-1)[: job.numel] * (1 + 1e-5) + 1e-6
                assert bool((gap <= bound).all()), job.name
                continue
            assert torch.allclose(want, job.averaged, atol=tol, rtol=tol), job.name


@pytest.mark.parametrize("spec", SPECS)
def test_residual_contract(spec: str) -> None:
    """Every job ends a step with ``decoded`` or a residual recorded by ``Job.keep`` (agreeing
    exactly where both are left); ``leftover`` records the residual once and returns a new
    fp32 tensor of the job's shape, finite with finite input. Over steps that cross a
    controller's level switch."""
    compressor = gradzip.compressor_from_spec(spec)
    comm = gradzip.SimulatedGroup(4)
    state = compressor.init_state(SHAPES)
    for step in range(4):
        ctx = StepContext(step=step, ranks=(0, 1, 2, 3), world_size=4, lr=0.1)
        jobs = [Job(n, g.clone()) for n, g in make_grads(4, step).items()]
        compressor.begin_step(state, comm, ctx)
        compressor.reduce(jobs, state, comm, ctx)
        for job in jobs:
            recorded = job.residual
            assert job.decoded is not None or recorded is not None, job.name
            if job.decoded is not None and recorded is not None:
                assert torch.equal(recorded, residual_after(job.tensor, job.decoded)), job.name
            rest = job.leftover()
            assert job.residual is rest and (recorded is None or rest is recorded)
            assert job.leftover() is rest  # recorded once
            assert rest.dtype == torch.float32 and rest.shape == job.tensor.shape
            assert rest.device == job.tensor.device
            assert rest.data_ptr() != job.tensor.data_ptr()  # the job's tensor stays its own
            assert bool(torch.isfinite(rest).all()), job.name
        compressor.end_step(state, ctx)


@pytest.mark.parametrize("spec", SPECS)
def test_error_feedback_identity_in_engine(spec: str) -> None:
    engine = gradzip.Engine(SHAPES, spec, collective=gradzip.SimulatedGroup(4), error_feedback=True)
    compressor = engine.compressor
    for step in range(3):
        grads = make_grads(4, step)
        old = {n: engine.residuals.get(n, torch.zeros(4, *s)) for n, s in SHAPES.items()}
        state_before = copy_tree(engine.compressor_state)
        engine.reduce(grads)
        # Replay the same step on the compressor alone from the state it started with.
        jobs = [Job(n, grads[n] + old[n]) for n in SHAPES]
        replay_state = state_before
        replay_comm = gradzip.SimulatedGroup(4)
        replay_ctx = StepContext(step=step, ranks=(0, 1, 2, 3), world_size=4)
        compressor.begin_step(replay_state, replay_comm, replay_ctx)
        compressor.reduce(jobs, replay_state, replay_comm, replay_ctx)
        for job in jobs:
            assert torch.equal(engine.residuals[job.name], job.leftover())
    if spec.startswith(("topk", "randk", "threshold")):
        # Sparsifiers send entries unchanged: every residual entry is the compensated entry
        # (not sent) or exactly zero (sent), and decoded + residual reproduces the tensor.
        # In the sharded exchange a worker's own part holds the owner's residual instead (the
        # sum it did not pass on), so only the other parts are compared there.
        forms = sharded_forms(compressor, 4)
        for job in jobs:
            residual = engine.residuals[job.name]
            owned = torch.zeros(residual.shape, dtype=torch.bool)
            # The threshold's budget with ``auto`` chooses each call's forms from its counts:
            # the sharded form is possible for every tensor there.
            if forms.get(job.name) == "sharded" or getattr(compressor, "chooses_by_count", False):
                part = -(-job.numel // 4)
                rows = torch.zeros(4, 4 * part, dtype=torch.bool)
                for w in range(4):
                    rows[w, w * part : (w + 1) * part] = True
                owned = rows[:, : job.numel].reshape(residual.shape)
            assert bool(((residual == 0) | (residual == job.tensor) | owned).all())
            rebuilt = job.own_decoded() + residual
            assert bool(((rebuilt == job.tensor) | owned).all())
            assert torch.allclose(rebuilt, job.tensor, atol=1e-6)


@pytest.mark.parametrize("spec", SPECS)
def test_state_dict_round_trip_resumes_bit_for_bit(spec: str) -> None:
    straight = engine_for(spec)
    expected = run(straight, range(6))
    first = engine_for(spec)
    run(first, range(3))
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = engine_for(spec)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    got = run(resumed, range(3, 6))
    for exp, out in zip(expected[3:], got, strict=True):
        for name in SHAPES:
            assert torch.equal(exp[name], out[name]), name
    assert resumed.stats == straight.stats


@pytest.mark.parametrize("spec", SPECS)
def test_seeded_determinism(spec: str) -> None:
    a = run(engine_for(spec), range(3))
    b = run(engine_for(spec), range(3))
    for x, y in zip(a, b, strict=True):
        for name in SHAPES:
            assert torch.equal(x[name], y[name])


def _lists_in(tree: object, out: list[list[object]]) -> list[list[object]]:
    """Every list object in a state tree (dicts searched, lists taken whole)."""
    if isinstance(tree, dict):
        for value in tree.values():
            _lists_in(value, out)
    elif isinstance(tree, list):
        out.append(tree)
    return out


def _same_value(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and (a == b or (a != a and b != b))  # NaN equals NaN here


@pytest.mark.parametrize("spec", SPECS)
def test_lists_in_state_are_replaced_never_changed_in_place(spec: str) -> None:
    # The engine's restore point of every step shares the lists of a state tree
    # (gradzip.statecheck.snapshot_tree): a list changed in place, or a record in it,
    # would change the snapshot too, and a skipped step could not be undone.
    engine = engine_for(spec)
    for step in range(6):
        lists = _lists_in(engine.compressor_state, [])
        before = [copy.deepcopy(x) for x in lists]
        engine.reduce(make_grads(4, step))
        for now, then in zip(lists, before, strict=True):
            assert _same_value(now, then), (spec, step)


@pytest.mark.parametrize("spec", SPECS)
def test_zero_gradient(spec: str) -> None:
    engine = engine_for(spec)
    zeros = {n: torch.zeros(4, *s) for n, s in SHAPES.items()}
    for _ in range(2):
        out = engine.reduce(zeros)
        for name in SHAPES:
            assert torch.equal(out[name], torch.zeros(SHAPES[name])), name
    for res in engine.residuals.values():
        assert torch.equal(res, torch.zeros_like(res))


@pytest.mark.parametrize("spec", SPECS)
def test_one_element_tensors_and_world_of_one(spec: str) -> None:
    shapes = {"a": torch.Size([1]), "b": torch.Size([1, 1])}
    engine = gradzip.Engine(shapes, spec, collective=gradzip.SimulatedGroup(1))
    grads = {"a": torch.tensor([[0.5]]), "b": torch.tensor([[[-2.0]]])}
    out = engine.reduce(grads)
    assert out["a"].shape == (1,) and out["b"].shape == (1, 1)
    for name in shapes:
        # With one worker, result + residual is the gradient (nothing is lost, only delayed).
        res = engine.residuals.get(name, torch.zeros(1, *shapes[name]))[0]
        tol = DECODE_TOL.get(spec, 1e-6)
        assert torch.allclose(out[name] + res, grads[name][0], atol=tol, rtol=tol)


@pytest.mark.parametrize("spec", SPECS)
def test_non_contiguous_input(spec: str) -> None:
    grads = make_grads(4, 0)
    strided = {}
    for name, g in grads.items():
        if g.dim() >= 3:
            # Same values, transposed storage.
            strided[name] = g.transpose(-1, -2).contiguous().transpose(-1, -2)
            assert not strided[name].is_contiguous()
        else:
            strided[name] = g
    a = engine_for(spec).reduce(grads)
    b = engine_for(spec).reduce(strided)
    for name in SHAPES:
        assert torch.equal(a[name], b[name])


@pytest.mark.slow
def test_compressors_converge_with_error_feedback() -> None:
    """Over many steps of one fixed gradient, error feedback delivers all of it."""
    for spec in ("topk:ratio=0.05", "sign", "powersgd:rank=1", "threshold:lam=2.5"):
        engine = engine_for(spec)
        grads = make_grads(4, 0)
        total = {n: torch.zeros(s) for n, s in SHAPES.items()}
        steps = 400
        for _ in range(steps):
            for name, avg in engine.reduce(grads).items():
                total[name] += avg
        for name in SHAPES:
            want = grads[name].mean(0)
            got = total[name] / steps
            rel = float((got - want).norm() / want.norm())
            assert rel < 0.1, (spec, name, rel)
