"""PowerSGD after one huge but finite gradient: the orthogonalisation's norm must not overflow
into a zero factor, which is finite (so no non-finite policy fires) and silently zeroes the
average, step after step, while the residual keeps the huge value."""

from __future__ import annotations

import pytest
import torch

import gradzip
from gradzip.ops import orthogonalize


@pytest.mark.parametrize("magnitude", [1e-45, 1e-30, 1e20, 1e30, 3e38])
@pytest.mark.parametrize("columns", [1, 3])
def test_orthogonalize_gives_orthonormal_columns_at_any_finite_magnitude(
    magnitude: float, columns: int
) -> None:
    base = torch.randn(16, columns, generator=torch.Generator().manual_seed(0))
    # Entries of one magnitude and random signs: finite whatever the magnitude.
    p = torch.where(base > 0, magnitude, -magnitude)
    p[:, 1:] *= torch.linspace(0.5, 1.0, 16).unsqueeze(1)  # independent columns for QR
    q = orthogonalize(p)
    assert bool(torch.isfinite(q).all())
    gram = q.transpose(-1, -2) @ q
    assert torch.allclose(gram, torch.eye(columns), atol=1e-5), gram
    # The column space is the input's: the single column is p's direction.
    if columns == 1:
        assert torch.allclose(q, p.sign() / 4, atol=1e-6)


def test_orthogonalize_is_unchanged_for_ordinary_inputs() -> None:
    """The rescale multiplies ordinary columns by exactly 1: the result is bit for bit the
    plain normalisation."""
    p = torch.randn(4, 32, 1, generator=torch.Generator().manual_seed(1))
    assert torch.equal(orthogonalize(p), p / p.norm(dim=-2, keepdim=True))


def _run(policy: str, workers: int, on_device: bool,
         steps: int = 8) -> tuple[gradzip.Engine, list[torch.Tensor]]:
    engine = gradzip.Engine(
        {"w": torch.Size([16, 16])},
        "powersgd:rank=1",
        collective=gradzip.SimulatedGroup(workers),
        nonfinite=policy,
    )
    engine.decide_on = "device" if on_device else "auto"  # the device-decided path, on the CPU
    gen = torch.Generator().manual_seed(1)
    outs = []
    for step in range(steps):
        grads = {"w": torch.randn(workers, 16, 16, generator=gen)}
        if step == 1:
            grads["w"][0] = 1e20  # one worker's whole gradient, finite in fp32
        outs.append(engine.reduce(grads)["w"])
    return engine, outs


@pytest.mark.parametrize("policy", ["skip", "zero", "raise"])
@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("on_device", [False, True])
def test_one_huge_gradient_is_averaged_and_training_recovers(
    policy: str, workers: int, on_device: bool
) -> None:
    engine, outs = _run(policy, workers, on_device)
    # The huge step is representable, so it is compressed, not handled by a policy: its
    # average is the huge worker's share (rank 1 captures a constant matrix).
    assert engine.stats["skipped_steps"] == 0
    assert torch.allclose(outs[1], torch.full((16, 16), 1e20 / workers), rtol=1e-3)
    # Every later step is finite and non-zero (before the fix every second one was all zero),
    # and the residual falls back to the gradients' scale instead of keeping 1e20.
    for step, out in enumerate(outs):
        assert bool(torch.isfinite(out).all()), step
        assert float(out.abs().max()) > 0, step
    assert float(engine.residuals["w"].abs().max()) < 1e3
    assert bool(torch.isfinite(engine.compressor_state["q"]["w"]).all())
    assert float(outs[-1].abs().max()) < 1e3


def test_a_gradient_that_overflows_the_factors_is_still_handled_by_the_policy() -> None:
    """The rescale removes only the norm's overflow: a gradient whose product ``M Q`` itself
    overflows still reports a non-finite step to every policy."""
    for policy in ("skip", "zero", "raise"):
        engine = gradzip.Engine({"w": torch.Size([16, 16])}, "powersgd:rank=1",
                                collective=gradzip.SimulatedGroup(2), nonfinite=policy)
        engine.reduce({"w": torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(2))})
        before = engine.state_dict()
        grads = {"w": torch.full((2, 16, 16), 3e38)}
        if policy == "raise":
            with pytest.raises(FloatingPointError):
                engine.reduce(grads)
        else:
            out = engine.reduce(grads)["w"]
            assert engine.stats["skipped_steps"] == 1
            assert bool(torch.isnan(out).all()) if policy == "skip" else bool((out == 0).all())
        assert torch.equal(engine.compressor_state["q"]["w"], before["compressor_state"]["q"]["w"])
        assert torch.equal(engine.residuals["w"], before["residuals"]["w"])
