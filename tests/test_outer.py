"""The outer loop in a simulated group: its algorithms against hand-written references,
streaming's delay semantics, exact resume, non-finite pseudo-gradients and bad input."""

from __future__ import annotations

import pytest
import torch

import gradzip
from gradzip.comm.base import allgather_wire_bytes, allreduce_wire_bytes
from gradzip.compressors.base import sparse_pays
from gradzip.ops.chunks import chunk_topk
from gradzip.outer import FragmentPlan, OuterOptimizer, split_fragments
from gradzip.outer.consensus import agree_on_parameters, parameter_digest
from outer_helpers import (
    batch,
    inner_step,
    make_inner,
    make_model,
    params_of,
    round_trip,
    run_simulated,
)

WORKERS = 3


def _reference(steps: int, outer_update, plan: FragmentPlan, alpha: float = 0.0, inner: str = "sgd"):
    """A plain-torch outer loop: every worker's model, the anchor, and ``outer_update(name,
    anchor, sum_of_deltas)`` returning the new anchor; fragments sent and applied as the plan
    says, the average of the deltas summed in rank order."""
    models = [make_model() for _ in range(WORKERS)]
    opts = [make_inner(m, inner) for m in models]
    names = [n for n, _ in models[0].named_parameters()]
    frags = split_fragments(names, plan.fragments)
    anchor = params_of(models[0])
    pending = None
    for step in range(steps):
        for rank, (model, opt) in enumerate(zip(models, opts, strict=True)):
            inner_step(model, opt, step, rank)
        count = step + 1
        per_worker = [dict(m.named_parameters()) for m in models]
        if pending is not None and pending[1] == count:
            _apply(pending, anchor, per_worker, frags, outer_update, alpha)
            pending = None
        fragment = plan.sent_after(count)
        if fragment is not None:
            sums = {}
            for name in frags[fragment]:
                total = anchor[name] - per_worker[0][name].detach()
                for params in per_worker[1:]:
                    total = total + (anchor[name] - params[name].detach())
                sums[name] = total / WORKERS
            pending = (fragment, count + plan.delay, sums)
            if plan.delay == 0:
                _apply(pending, anchor, per_worker, frags, outer_update, alpha)
                pending = None
    return models


@torch.no_grad()
def _apply(pending, anchor, per_worker, frags, outer_update, alpha):
    fragment, _, averaged = pending
    for name in frags[fragment]:
        anchor[name] = outer_update(name, anchor[name], averaged[name])
        for params in per_worker:
            params[name].copy_(anchor[name] if alpha == 0 else anchor[name].lerp(params[name], alpha))


def _assert_same(models_a, models_b, exact=True, tol=0.0):
    for a, b in zip(models_a, models_b, strict=True):
        for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
            if exact:
                assert torch.equal(pa, pb), name
            else:
                assert torch.allclose(pa, pb, atol=tol, rtol=tol), (name, float((pa - pb).abs().max()))


def test_none_with_plain_sgd_lr_1_is_periodic_parameter_averaging_bit_for_bit() -> None:
    plan = FragmentPlan(4)
    models, outer = run_simulated(WORKERS, 13, "none", inner_steps=4, outer_optimizer="sgd", outer_lr=1.0)
    ref = _reference(13, lambda n, anchor, avg: anchor - avg, plan)
    _assert_same(models, ref)
    assert outer.stats["syncs"] == 3
    # And that is the mean of the workers' parameters, up to rounding: replay to step 12.
    replay = [make_model() for _ in range(WORKERS)]
    opts = [make_inner(m) for m in replay]
    for step in range(12):
        for rank, (model, opt) in enumerate(zip(replay, opts, strict=True)):
            inner_step(model, opt, step, rank)
        if (step + 1) % 4 == 0:
            with torch.no_grad():
                for params in zip(*(m.parameters() for m in replay), strict=True):
                    mean = torch.stack(params).mean(0)
                    for p in params:
                        p.copy_(mean)
    synced, _ = run_simulated(WORKERS, 12, "none", inner_steps=4, outer_optimizer="sgd", outer_lr=1.0)
    _assert_same(synced, replay, exact=False, tol=1e-6)


def test_h1_with_inner_sgd_matches_per_step_averaged_sgd() -> None:
    """H = 1, plain outer SGD at lr 1: every step averages the workers' SGD steps, which is
    SGD on the averaged gradient up to rounding (stated tolerance: 1e-6 over 20 steps)."""
    models, _ = run_simulated(WORKERS, 20, "none", inner_steps=1, outer_optimizer="sgd", outer_lr=1.0)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(20):
        grads = []
        for rank in range(WORKERS):
            x, y = batch(step, rank)
            model.zero_grad()
            (model(x) - y).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads, strict=True):
            p.grad = torch.stack(gs).mean(0)
        opt.step()
    for a, b in zip(models[0].parameters(), model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)


def test_nesterov_outer_optimizer_is_torch_sgd_bit_for_bit() -> None:
    opt = OuterOptimizer("nesterov")
    assert (opt.lr, opt.momentum) == (0.7, 0.9)
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, 4, generator=gen))
    ref = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    anchor, state = p.detach().clone(), {}
    for _ in range(5):
        update = torch.randn(5, 4, generator=gen)
        p.grad = update.clone()
        ref.step()
        anchor = opt.apply("w", anchor, update, state)
        assert torch.equal(anchor, p.detach())


def test_diloco_nesterov_matches_reference() -> None:
    # The default outer step at H = 4: Nesterov with the rule's lr and momentum at that H.
    opt = OuterOptimizer.build("nesterov", inner_steps=4)
    state: dict = {}
    models, _ = run_simulated(WORKERS, 12, "none", inner_steps=4, inner="adamw")
    ref = _reference(12, lambda n, a, avg: opt.apply(n, a, avg, state), FragmentPlan(4), inner="adamw")
    _assert_same(models, ref)


@pytest.mark.parametrize("overlap", [False, True])
def test_streaming_delay_and_mixing_follow_the_sequential_semantics_exactly(overlap: bool) -> None:
    """Sent after steps 2, 4, ...; applied one step later (on a background thread with
    ``overlap``: the same bits)."""
    plan = FragmentPlan(4, fragments=2, delay=1)
    kwargs = dict(inner_steps=4, fragments=2, delay=1, alpha=0.5, outer_optimizer="sgd", outer_lr=0.7,
                  overlap=overlap)
    models, outer = run_simulated(WORKERS, 15, "none", **kwargs)
    ref = _reference(15, lambda n, a, avg: a.add(avg, alpha=-0.7), plan, alpha=0.5)
    _assert_same(models, ref)
    assert outer.stats["syncs"] == 7  # sends after steps 2, 4, ..., 14
    assert outer.pending is None  # the send after step 14 was applied after step 15
    # Fragments are strided over the tensors.
    names = [n for n, _ in models[0].named_parameters()]
    assert outer.fragments == [tuple(names[0::2]), tuple(names[1::2])]


def test_ef_momentum_decays_the_residual_and_sends_chunked_topk() -> None:
    """SparseLoCo's step, replayed by hand: e <- 0.95 e + delta; send the top entries of each
    chunk of e; e <- e - sent; anchor <- anchor - mean(sent) (outer lr 1)."""
    spec = "chunktopk:chunk=32,k=4"
    models, outer = run_simulated(WORKERS, 12, spec, inner_steps=3, outer_optimizer="ef-momentum")
    assert outer.optimizer.decay == 0.95 and outer.optimizer.lr == 1.0
    compressor, comm = gradzip.ChunkTopK(chunk=32, k=4), gradzip.SimulatedGroup(WORKERS)
    refs = [make_model() for _ in range(WORKERS)]
    opts = [make_inner(m) for m in refs]
    anchor = params_of(refs[0])
    errors = {n: torch.zeros(WORKERS, *t.shape) for n, t in anchor.items()}
    for step in range(12):
        for rank, (model, opt) in enumerate(zip(refs, opts, strict=True)):
            inner_step(model, opt, step, rank)
        if (step + 1) % 3:
            continue
        with torch.no_grad():
            for name in anchor:
                cur = torch.stack([dict(m.named_parameters())[name].detach() for m in refs])
                e = 0.95 * errors[name] + (anchor[name] - cur)
                flat = e.reshape(WORKERS, -1)
                values, idx, _ = chunk_topk(flat, 32, 4)
                if not sparse_pays(flat.shape[1], compressor.message_bytes(flat.shape[1]), 1, comm):
                    sent = flat.clone()
                else:
                    sent = torch.zeros_like(flat).scatter_(1, idx, values)
                errors[name] = (flat - sent).reshape(e.shape)
                anchor[name] = anchor[name] - sent.mean(0).reshape(anchor[name].shape)
                for m in refs:
                    dict(m.named_parameters())[name].copy_(anchor[name])
    _assert_same(models, refs, exact=False, tol=1e-6)


def _mode_kwargs() -> dict[str, tuple[str, dict]]:
    return {
        "diloco": ("none", dict(inner_steps=4)),
        "streaming": ("chunktopk:chunk=32,k=8", dict(inner_steps=4, fragments=2, delay=1, alpha=0.5,
                                                     overlap=True)),
        "sparseloco": ("chunktopk:chunk=32,k=4,bits=2,average=senders",
                       dict(inner_steps=3, outer_optimizer="ef-momentum")),
    }


@pytest.mark.parametrize("mode", ["diloco", "streaming", "sparseloco"])
@pytest.mark.parametrize("cut", [2, 3, 5, 7])
def test_state_dict_resume_is_exact_mid_interval_and_across_fragments(mode: str, cut: int) -> None:
    """Saved after ``cut`` steps (mid-interval, at a sync, with an exchange in flight) and
    resumed in fresh objects: the same parameters and counters as the run never stopped."""
    spec, kwargs = _mode_kwargs()[mode]
    steps = 11
    straight, outer = run_simulated(WORKERS, steps, spec, inner="adamw", **kwargs)

    def build():
        models = [make_model() for _ in range(WORKERS)]
        opts = [make_inner(m, "adamw") for m in models]
        return models, opts, gradzip.Outer(models, spec, collective=gradzip.SimulatedGroup(WORKERS),
                                           inner_optimizers=opts, **kwargs)

    first, opts, o1 = build()
    for step in range(cut):
        for rank, (model, opt) in enumerate(zip(first, opts, strict=True)):
            inner_step(model, opt, step, rank)
        o1.step()
    saved = round_trip({"models": [m.state_dict() for m in first], "outer": o1.state_dict()})
    resumed, ropts, o2 = build()  # built from identical models, then the checkpoint loaded
    for m, sd in zip(resumed, saved["models"], strict=True):
        m.load_state_dict(sd)
    o2.load_state_dict(saved["outer"])
    for step in range(cut, steps):
        for rank, (model, opt) in enumerate(zip(resumed, ropts, strict=True)):
            inner_step(model, opt, step, rank)
        o2.step()
    _assert_same(straight, resumed)
    assert o2.stats == outer.stats


def test_controllers_run_on_pseudo_gradients() -> None:
    """Accordion decides from the pseudo-gradients' per-layer norms between synchronisations:
    one decision record per interval of exchanges, levels reported for the next one."""
    spec = ("accordion(steady=chunktopk:chunk=32,k=2,critical=chunktopk:chunk=32,k=16,"
            "eta=0.5,interval=2,per_layer=True,lr_drop=False)")
    models, outer = run_simulated(WORKERS, 24, spec, inner_steps=3)
    assert outer.stats["syncs"] == 8
    report = outer.engine.compressor.report(outer.engine.compressor_state)
    assert report["counts"]["decisions"] >= 3
    assert set(report["levels"]) <= {n for n, _ in models[0].named_parameters()}
    for m in models[1:]:
        for a, b in zip(models[0].parameters(), m.parameters(), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["diloco", "streaming", "sparseloco"])
def test_consensus_is_the_workers_mean_and_changes_nothing(mode: str) -> None:
    """``consensus()`` after every step: the rank-order mean of the replicas, bit for bit;
    only a 24-byte digest per worker where they are equal; and the run (parameters, every
    counter but its own) exactly that of a run that never asked."""
    spec, kwargs = _mode_kwargs()[mode]
    steps = 11
    straight, untouched = run_simulated(WORKERS, steps, spec, inner="adamw", **kwargs)
    models = [make_model() for _ in range(WORKERS)]
    opts = [make_inner(m, "adamw") for m in models]
    outer = gradzip.Outer(models, spec, collective=gradzip.SimulatedGroup(WORKERS), **kwargs)
    digests_only = allgather_wire_bytes(24, WORKERS)
    equal_seen = differ_seen = 0
    for step in range(steps):
        for rank, (model, opt) in enumerate(zip(models, opts, strict=True)):
            inner_step(model, opt, step, rank)
        outer.step()
        sent = outer.consensus_wire_bytes
        mean = outer.consensus()
        replicas = [params_of(m) for m in models]
        equal = all(torch.equal(r[n], replicas[0][n]) for r in replicas for n in r)
        for name, value in mean.items():
            expect = (replicas[0][name] + replicas[1][name] + replicas[2][name]) / WORKERS
            assert torch.equal(value, replicas[0][name] if equal else expect), (step, name)
        grew = outer.consensus_wire_bytes - sent
        if equal:
            equal_seen += 1
            assert grew == digests_only
        else:
            differ_seen += 1
            assert grew > digests_only
    assert differ_seen and (equal_seen or kwargs.get("alpha"))  # alpha keeps them apart
    _assert_same(straight, models)
    stats = outer.stats
    assert stats.pop("consensus_wire_bytes") > 0
    assert stats == {k: v for k, v in untouched.stats.items() if k != "consensus_wire_bytes"}


def test_equal_replicas_send_only_their_digests_and_different_ones_are_averaged() -> None:
    rows = torch.randn(1, 1000).expand(3, -1).contiguous()
    comm = gradzip.SimulatedGroup(3)
    assert agree_on_parameters(rows, comm) is None
    assert comm.meter.payload == [24] * 3 and comm.meter.wire == [allgather_wire_bytes(24, 3)] * 3
    # One entry of one worker one ulp away: a digest differs, the dense mean is sent.
    drifted = rows.clone()
    drifted[2, 417] = torch.nextafter(drifted[2, 417], torch.tensor(2.0))
    assert not torch.equal(parameter_digest(drifted)[2], parameter_digest(drifted)[0])
    comm = gradzip.SimulatedGroup(3)
    mean = agree_on_parameters(drifted, comm)
    assert mean is not None and torch.equal(mean, drifted.sum(dim=0) / 3)
    # The mean is added in rank order: an all-to-all then an all-gather of a third each, a
    # ring all-reduce's bytes (for 1000 entries, rounded up to a multiple of 3).
    assert comm.meter.wire == [allgather_wire_bytes(24, 3) + allreduce_wire_bytes(4 * 1002, 3)] * 3
    # Two entries swapped: the sums agree, the position-weighted sum does not.
    swapped = rows.clone()
    swapped[1, [3, 7]] = swapped[1, [7, 3]]
    assert agree_on_parameters(swapped, gradzip.SimulatedGroup(3)) is not None
