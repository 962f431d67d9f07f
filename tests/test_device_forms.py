"""The forms other devices take equal the CPU's own forms, bit for bit, on the CPU.

Some ops take a CPU-only form (NumPy's packing and selection, the compiled QSGD decoder,
chunked loops); on a GPU the same op is a whole-tensor torch form. ``device_forms`` makes the
CPU take the GPU's forms, so both are checked here: the same averages, residuals, compressor
state and byte counts, through several steps of several workers, with tensors large enough
to reach every size-dependent branch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gradzip
from gradzip.comm.simulated import SimulatedGroup
from gradzip.ops.branches import cpu_form, device_forms

SHAPES = {"big": (70_000,), "conv": (16, 8, 3, 3), "fc": (10, 64), "bias": (64,)}
SPECS = ["topk:ratio=0.01", "topk:ratio=0.3", "randk:ratio=0.05", "qsgd:levels=4",
         "qsgd:levels=16", "qsgd:levels=100", "sign", "threshold:lam=0.5",
         "threshold:budget=0.05", "powersgd:rank=2", "none", "fp16"]


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [x for key in sorted(tree) for x in _leaves(tree[key])]
    if isinstance(tree, (list, tuple)):
        return [x for item in tree for x in _leaves(item)]
    return [tree]


def _run(spec: str) -> tuple[list[dict[str, torch.Tensor]], dict[str, Any]]:
    engine = gradzip.Engine(SHAPES, spec, collective=SimulatedGroup(3))
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(3):
        grads = {n: torch.randn(3, *s, generator=gen) for n, s in SHAPES.items()}
        out.append(engine.reduce(grads))
    return out, engine.state_dict()


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("spec", SPECS)
def test_device_forms_equal_the_cpu_forms(spec: str) -> None:
    cpu_results, cpu_state = _run(spec)
    with device_forms():
        dev_results, dev_state = _run(spec)
    for mine, theirs in zip(cpu_results, dev_results, strict=True):
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[n], theirs[n]) for n in mine), spec
    for key in ("residuals", "compressor_state", "meter", "dense_payload", "skipped_steps"):
        left, right = _leaves(cpu_state[key]), _leaves(dev_state[key])
        assert len(left) == len(right), key
        assert all(_equal(a, b) for a, b in zip(left, right, strict=True)), (spec, key)


def test_device_forms_is_scoped_and_nests() -> None:
    cpu = torch.device("cpu")
    assert cpu_form(cpu)
    with device_forms():
        assert not cpu_form(cpu)
        with device_forms():
            assert not cpu_form(cpu)
        assert not cpu_form(cpu)
    assert cpu_form(cpu)
    with pytest.raises(RuntimeError), device_forms():
        raise RuntimeError("inside")
    assert cpu_form(cpu)
