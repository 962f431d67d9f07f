"""Engine behaviour: validation, checkpoints, non-finite gradients, rank agreement, failures."""

from __future__ import annotations

import os
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradzip
from conformance import SHAPES, make_grads
from gradzip.comm import run_processes, shutdown_process_group
from gradzip.compressors.sparse import _as_words, _from_words, index_bytes, scatter_decode
from gradzip.statecheck import check_tree


def sim_engine(spec: str = "topk:ratio=0.05", **kwargs: object) -> gradzip.Engine:
    return gradzip.Engine(SHAPES, spec, collective=gradzip.SimulatedGroup(4), **kwargs)


# -- validation -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "exc", "fragment"),
    [
        ({"params": 3}, TypeError, "`params` must be a module"),
        ({"compressor": "topk:ratio=2"}, ValueError, "`ratio` must be in (0, 1], got 2.0"),
        ({"error_feedback": "yes"}, TypeError, "`error_feedback` must be a bool or None, got 'yes'"),
        ({"nonfinite": "ignore"}, ValueError, "`nonfinite` must be one of 'skip', 'zero', 'raise'"),
        ({"collective": object()}, TypeError, "`collective` must be a gradzip Collective"),
        ({"optimizer": "sgd"}, TypeError, "`optimizer` must be a torch.optim.Optimizer"),
    ],
)
def test_engine_validates_arguments(kwargs: dict, exc: type, fragment: str) -> None:
    args = {"params": SHAPES, "compressor": "none", "collective": gradzip.SimulatedGroup(2)}
    args.update(kwargs)
    params, compressor = args.pop("params"), args.pop("compressor")
    with pytest.raises(exc) as info:
        gradzip.Engine(params, compressor, **args)
    assert fragment in str(info.value)


def test_reduce_validates_names_and_shapes() -> None:
    engine = sim_engine()
    with pytest.raises(ValueError, match="unknown name 'nope'"):
        engine.reduce({"nope": torch.zeros(4, 3)})
    with pytest.raises(ValueError, match=r"must have shape \(4, 16\) \(workers first\), got \(16,\)"):
        engine.reduce({"conv.bias": torch.zeros(16)})
    with pytest.raises(TypeError, match="must be a mapping"):
        engine.reduce([torch.zeros(1)])  # type: ignore[arg-type]


def test_engine_from_module_reduce_in_place_world_of_one() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    model[1].bias.requires_grad_(False)  # a frozen parameter is not part of the engine
    engine = gradzip.Engine(model, "none")
    assert set(engine.shapes) == {"0.weight", "0.bias", "1.weight"}
    model(torch.randn(5, 4)).sum().backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    engine.reduce_()
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert torch.equal(p.grad, before[name])
    assert engine.stats["wire_bytes"] == [0]  # nothing travels with one worker


def test_empty_model_and_empty_call() -> None:
    engine = gradzip.Engine({}, "powersgd:rank=2", collective=gradzip.SimulatedGroup(2))
    assert engine.reduce({}) == {}
    assert engine.step == 1


def test_partial_calls_count_one_step() -> None:
    engine = sim_engine("threshold:budget=0.05")
    grads = make_grads(4, 0)
    names = list(grads)
    engine.reduce({n: grads[n] for n in names[:2]}, finish_step=False)
    assert engine.step == 0
    engine.reduce({n: grads[n] for n in names[2:]}, finish_step=True)
    assert engine.step == 1


# -- checkpoints --------------------------------------------------------------------------------
def test_load_state_dict_names_the_first_mismatch() -> None:
    source = sim_engine("powersgd:rank=2")
    source.reduce(make_grads(4, 0))
    state = source.state_dict()
    with pytest.raises(ValueError, match="`compressor` of the checkpoint must be 'powersgd:rank=4'"):
        sim_engine("powersgd:rank=4").load_state_dict(state)
    other_shapes = dict(SHAPES)
    other_shapes["fc.weight"] = torch.Size([32, 65])
    engine = gradzip.Engine(other_shapes, "powersgd:rank=2", collective=gradzip.SimulatedGroup(4))
    with pytest.raises(ValueError, match=r"residual 'fc.weight' must match a parameter of shape \(4, 32, 65\)"):
        engine.load_state_dict(state)
    bad = dict(state)
    bad["format_version"] = 99
    with pytest.raises(ValueError, match="`format_version` must be 1, got 99"):
        sim_engine("powersgd:rank=2").load_state_dict(bad)
    bad = dict(state, residuals={})
    bad["compressor_state"] = {"q": {}}
    with pytest.raises(ValueError, match=r"compressor_state.q: missing keys"):
        sim_engine("powersgd:rank=2").load_state_dict(bad)


def test_state_dict_refused_inside_a_step() -> None:
    engine = sim_engine()
    grads = make_grads(4, 0)
    engine.reduce({"scale": grads["scale"]}, finish_step=False)
    with pytest.raises(RuntimeError, match="between steps"):
        engine.state_dict()


# -- tensors sent dense -----------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["topk:ratio=0.05", "threshold:budget=0.02", "powersgd:rank=2",
                                  "accordion(steady=topk:ratio=0.05,critical=topk:ratio=0.5,interval=2)"])
def test_dense_1d_sends_vectors_exactly_and_keeps_no_state_for_them(spec: str) -> None:
    engine = sim_engine(spec, dense_1d=True)
    vectors = {n for n, s in SHAPES.items() if len(s) < 2}
    assert vectors and engine.dense_names == vectors
    for step in range(3):
        grads = make_grads(4, step)
        out = engine.reduce(grads)
        for name in vectors:
            torch.testing.assert_close(out[name], grads[name].mean(0), rtol=0, atol=1e-6)
    assert not vectors & set(engine.residuals)
    assert set(engine.residuals) == set(SHAPES) - vectors
    # The compressor never sees them: its state is what a model without them would have.
    without = {n: s for n, s in SHAPES.items() if n not in vectors}
    fresh = gradzip.Engine(without, spec, collective=gradzip.SimulatedGroup(4))
    assert check_tree(fresh.compressor_state, engine.compressor_state, "state") is None
    if spec in ("topk:ratio=0.05", "threshold:budget=0.02"):
        # Sparsified vectors cost less than their exact all-reduce does with dense_1d.
        plain, one = sim_engine(spec), sim_engine(spec, dense_1d=True)
        plain.reduce(make_grads(4, 0))
        one.reduce(make_grads(4, 0))
        assert one.stats["payload_bytes"][0] > plain.stats["payload_bytes"][0]


def test_dense_1d_is_part_of_the_checkpoint_and_validated() -> None:
    engine = sim_engine("topk:ratio=0.05", dense_1d=True)
    engine.reduce(make_grads(4, 0))
    state = engine.state_dict()
    assert state["dense_1d"] is True
    again = sim_engine("topk:ratio=0.05", dense_1d=True)
    again.load_state_dict(state)
    with pytest.raises(ValueError, match="`dense_1d` of the checkpoint must be False, got True"):
        sim_engine("topk:ratio=0.05").load_state_dict(state)
    with pytest.raises(TypeError, match="`dense_1d`"):
        sim_engine("topk:ratio=0.05", dense_1d=1)


# -- non-finite gradients ---------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["topk:ratio=0.05", "powersgd:rank=2", "threshold:budget=0.02", "sign"])
def test_one_bad_gradient_skips_the_step_and_keeps_state(spec: str) -> None:
    clean, hit = sim_engine(spec), sim_engine(spec)
    for step in range(2):
        clean.reduce(make_grads(4, step))
        hit.reduce(make_grads(4, step))
    bad = make_grads(4, 99)
    bad["fc.weight"][2, 3, 4] = float("inf")  # one entry on one worker
    names = list(bad)
    # Split into two calls (as DDP buckets would): the first is clean, the second is not.
    first = hit.reduce({n: bad[n] for n in names[:2]}, finish_step=False)
    out = hit.reduce({n: bad[n] for n in names[2:]}, finish_step=True)
    assert all(torch.isfinite(v).all() for v in first.values())
    assert all(torch.isnan(v).all() for v in out.values())
    assert hit.stats["skipped_steps"] == 1
    # Training continues as if the bad step never happened (step counters aside).
    for step in range(2, 5):
        a, b = clean.reduce(make_grads(4, step)), hit.reduce(make_grads(4, step))
        for name in SHAPES:
            assert torch.isfinite(b[name]).all()
            assert torch.equal(a[name], b[name]), (spec, step, name)
    for name, res in clean.residuals.items():
        assert torch.equal(res, hit.residuals[name])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_huge_finite_gradients_are_not_mistaken_for_overflow(dtype: torch.dtype) -> None:
    """The finiteness check sums each tensor first; a sum that overflows although every entry
    is finite must fall through to the exact test, not skip the step."""
    big = torch.finfo(dtype).max / 4  # a tensor's sum overflows, two workers' sum does not
    engine = gradzip.Engine({"w": torch.Size([64])}, "topk:ratio=0.25",
                            collective=gradzip.SimulatedGroup(2))
    grads = torch.full((2, 64), big, dtype=dtype)
    grads[1, ::2] = -big
    out = engine.reduce({"w": grads})["w"]
    assert engine.stats["skipped_steps"] == 0 and bool(torch.isfinite(out).all())
    grads[0, 5] = float("nan")
    engine.reduce({"w": grads})
    assert engine.stats["skipped_steps"] == 1


def test_nonfinite_policies_zero_and_raise() -> None:
    bad = make_grads(4, 0)
    bad["conv.bias"][0, 0] = float("nan")
    out = sim_engine(nonfinite="zero").reduce(bad)
    assert all(torch.equal(v, torch.zeros_like(v)) for v in out.values())
    with pytest.raises(FloatingPointError, match="NaN or Inf at step 0"):
        sim_engine(nonfinite="raise").reduce(bad)


def test_gradscaler_skips_the_optimizer_step_on_a_nan_result() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    engine = gradzip.Engine(model, "topk:ratio=0.5")
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.tensor([[1e30, 1e30, 1e30]])).sum() * 1e30).backward()
    engine.reduce_()
    scaler.step(opt)
    scaler.update()
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, q)
    assert engine.stats["skipped_steps"] == 1
    assert engine.residuals == {}


# -- corrupt messages -------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    numel=st.integers(1, 50),
    idx=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=0, max_size=20),
)
def test_decoder_rejects_out_of_range_indices(numel: int, idx: list[int]) -> None:
    indices = torch.tensor([idx], dtype=torch.int64).reshape(1, -1)
    values = torch.ones_like(indices, dtype=torch.float32)
    if all(0 <= i < numel for i in idx):
        out = scatter_decode(values, indices, numel)
        assert out.shape == (numel,) and float(out.sum()) == len(idx)
    else:
        with pytest.raises(ValueError, match=r"message indices must lie in \[0, "):
            scatter_decode(values, indices, numel)


def test_int64_indices_beyond_int32_range() -> None:
    huge = 2**31 + 10
    assert index_bytes(huge) == 8 and index_bytes(2**31) == 4
    idx = torch.tensor([[0, 2**31 + 5, 7]])
    words = _as_words(idx, huge)
    assert words.shape == (1, 6)
    assert torch.equal(_from_words(words, huge), idx)


# -- several real processes -------------------------------------------------------------------
def _disagreeing(rank: int, world_size: int) -> str:
    spec = "topk:ratio=0.01" if rank == 0 else "topk:ratio=0.02"
    engine = gradzip.Engine(SHAPES, spec)
    try:
        engine.reduce({n: g[rank] for n, g in make_grads(world_size, 0).items()})
    except ValueError as err:
        return str(err)
    return "no error"


def _dying(rank: int, world_size: int) -> tuple[str, float]:
    engine = gradzip.Engine(SHAPES, "powersgd:rank=2")
    start = time.monotonic()
    for step in range(50):
        if rank == 2 and step == 3:
            os._exit(1)  # the worker dies mid-training
        try:
            engine.reduce({n: g[rank] for n, g in make_grads(world_size, step).items()})
        except Exception as err:  # noqa: BLE001 - reported back to the test
            return f"{type(err).__name__}: {err}", time.monotonic() - start
    return "finished", time.monotonic() - start


@pytest.mark.slow
def test_ranks_with_different_configurations_fail_at_the_first_step() -> None:
    messages = run_processes(_disagreeing, 2, timeout=120)
    for msg in messages:
        assert "ranks disagree on `compressor`" in msg


def _reduce_then_shut_down(rank: int, world_size: int) -> tuple[bool, bool]:
    engine = gradzip.Engine(SHAPES, "topk:ratio=0.1")
    engine.reduce({n: g[rank] for n, g in make_grads(world_size, 0).items()})
    before = torch.distributed.is_initialized()
    shutdown_process_group(settle_s=0.01)
    shutdown_process_group()  # a second call finds no group and does nothing
    return before, torch.distributed.is_initialized()


@pytest.mark.slow
def test_shutdown_process_group_leaves_together_and_destroys_the_group() -> None:
    assert run_processes(_reduce_then_shut_down, 2, timeout=120) == [(True, False)] * 2


def test_shutdown_process_group_validates_and_is_a_no_op_without_a_group() -> None:
    shutdown_process_group()
    with pytest.raises(ValueError, match="`settle_s` must be >= 0, got -1"):
        shutdown_process_group(settle_s=-1)
    with pytest.raises(TypeError, match="`settle_s`"):
        shutdown_process_group(settle_s="0.1")  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_dead_worker_makes_the_others_fail_instead_of_hanging() -> None:
    results = run_processes(_dying, 3, timeout=150, return_exceptions=True)
    assert isinstance(results[2], RuntimeError) and "exited with code 1" in str(results[2])
    for rank in (0, 1):
        message, _ = results[rank]
        assert message != "finished", message


def test_residuals_follow_the_loss_scale_of_a_grad_scaler() -> None:
    model = torch.nn.Linear(8, 4)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaled = gradzip.Engine(model, "topk:ratio=0.25", grad_scaler=scaler)
    plain = gradzip.Engine({n: p.shape for n, p in model.named_parameters()}, "topk:ratio=0.25")
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
        scaler.scale(torch.ones(()))  # what a loss does: makes the scaler hold a scale tensor
        scale = float(scaler.get_scale())
        out = scaled.reduce({n: g * scale for n, g in grads.items()})
        ref = plain.reduce(grads)
        for name in grads:
            # Powers of two: unscaling reproduces the unscaled engine bit for bit.
            assert torch.equal(out[name] / scale, ref[name]), (step, name)
        scaler.update(new_scale=scale * (0.5 if step % 2 == 0 else 4.0))
    assert scaled.residual_scale == 1024.0 * 0.5 * 4.0 * 0.5
    with pytest.raises(TypeError, match="`grad_scaler` must be a torch.amp.GradScaler"):
        gradzip.Engine(model, "none", grad_scaler=object())
