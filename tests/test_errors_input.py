"""One-line errors for malformed engine input: parameter forms, gradient dtypes, zero-size
tensors, and bit packing outside its code range."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradzip
from gradzip.ddp import make_hook
from gradzip.ops.bits import pack_bits, unpack_bits


# -- what an engine is built from ---------------------------------------------------------
@pytest.mark.parametrize(
    ("params", "exc", "fragment"),
    [
        (lambda: nn.Linear(2, 2).parameters(), TypeError,
         "entry 0 is a bare Parameter with no name (pass model.named_parameters()"),
        (lambda: [torch.zeros(3)], TypeError, "entry 0 is a bare Tensor with no name"),
        (lambda: [("a", 3)], TypeError, "entry 0 ('a') holds int 3, expected a tensor"),
        (lambda: [("a",)], TypeError, "entry 0 is ('a',), expected a (name, tensor) pair"),
        (lambda: [(1, torch.zeros(2))], TypeError, "entry 0 has name 1, expected a non-empty"),
        (lambda: [("a", torch.zeros(2)), ("a", torch.zeros(2))], ValueError,
         "`params` names must be unique, got 'a' twice"),
        (lambda: {"w": (-1, 2)}, ValueError,
         "`params`['w'] must be a shape of non-negative dimensions, got (-1, 2)"),
        (lambda: {"w": (2.0,)}, TypeError,
         "`params`['w'] must be a shape (a tuple of non-negative integers), got (2.0,)"),
        (lambda: {"w": "3"}, TypeError, "`params`['w'] must be a shape"),
        (lambda: {"w": (True,)}, TypeError, "`params`['w'] must be a shape"),
        (lambda: {3: (2,)}, TypeError, "has name 3, expected a non-empty string"),
        (lambda: "w", TypeError, "`params` must be a module, an iterable of (name, parameter)"),
    ],
)
def test_engine_refuses_malformed_params(params, exc: type, fragment: str) -> None:
    with pytest.raises(exc) as info:
        gradzip.Engine(params(), "none", collective=gradzip.SimulatedGroup(2))
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message
    # The expected form is part of every refusal of the container or an entry.
    if "`params` must be a module" in message:
        assert "model.named_parameters()" in message


def test_engine_still_takes_every_documented_form() -> None:
    model = nn.Linear(3, 2)
    for params in (model, model.named_parameters(), {"w": (2, 3), "b": torch.zeros(2)},
                   {"w": torch.Size([0, 3])}):
        engine = gradzip.Engine(params, "none", collective=gradzip.SimulatedGroup(2))
        assert engine.shapes


# -- gradient dtypes ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.complex64, torch.int64, torch.int32, torch.bool])
def test_reduce_refuses_unsupported_gradient_dtypes(dtype: torch.dtype) -> None:
    engine = gradzip.Engine({"w": (4,)}, "topk:ratio=0.5", collective=gradzip.SimulatedGroup(2))
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(TypeError, match=rf"gradient `w` must have a dtype in \(.*\), got {name}$"):
        engine.reduce({"w": torch.ones(2, 4).to(dtype)})
    # The refused call left the engine usable.
    out = engine.reduce({"w": torch.ones(2, 4)})
    assert out["w"].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_reduce_keeps_supported_float_dtypes(dtype: torch.dtype) -> None:
    engine = gradzip.Engine({"w": (4,)}, "none", collective=gradzip.SimulatedGroup(2))
    assert engine.reduce({"w": torch.ones(2, 4, dtype=dtype)})["w"].dtype == dtype


def test_complex_parameters_refused_by_engine_and_ddp_hook() -> None:
    class Complex(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(4, dtype=torch.complex64))

    fragment = "parameter `w` must have a dtype in (float16, bfloat16, float32, float64), got complex64"
    with pytest.raises(TypeError) as info:
        gradzip.Engine(Complex(), "none", collective=gradzip.SimulatedGroup(1))
    assert fragment in str(info.value)
    # DDP hands a hook a complex gradient as a real view of half its length, so the hook
    # must refuse the parameter when it is made, not wait for gradients.
    with pytest.raises(TypeError) as info:
        make_hook(Complex(), "none")
    assert fragment in str(info.value)


# -- zero-size tensors --------------------------------------------------------------------
ZERO_SPECS = ["qsgd:levels=7", "qsgd:levels=7,bucket_size=4", "qsgd:levels=100", "sign",
              "threshold:budget=0.1", "threshold:budget=0.1,padded=true", "threshold:lam=0.1",
              "topk:ratio=0.5", "randk:ratio=0.5", "powersgd:rank=1", "fp16", "bf16", "none"]


@pytest.mark.parametrize("jit", ["0", "1"])
@pytest.mark.parametrize("spec", ZERO_SPECS)
def test_zero_size_tensors_reduce(spec: str, jit: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADZIP_JIT", jit)
    workers = 3
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(workers, 6, generator=gen) for _ in range(3)]
    alone = gradzip.Engine({"b": (6,)}, spec, collective=gradzip.SimulatedGroup(workers))
    for shape in [(0,), (0, 3), (3, 0)]:
        # Only empty tensors, then an empty tensor beside a real one.
        empty = gradzip.Engine({"e": shape}, spec, collective=gradzip.SimulatedGroup(workers))
        for _ in range(2):
            out = empty.reduce({"e": torch.ones(workers, *shape)})
            assert out["e"].shape == shape
        empty.load_state_dict(empty.state_dict())
    mixed = gradzip.Engine({"e": (3, 0), "b": (6,)}, spec,
                           collective=gradzip.SimulatedGroup(workers))
    # Decisions kept on the device (the CUDA path), forced here on the CPU.
    on_device = [gradzip.Engine(shapes, spec, collective=gradzip.SimulatedGroup(workers))
                 for shapes in ({"e": (3, 0), "b": (6,)}, {"b": (6,)})]
    for engine in on_device:
        engine.decide_on = "device"
    for grad in grads:
        device_out = on_device[0].reduce({"e": torch.ones(workers, 3, 0), "b": grad})
        assert torch.equal(device_out["b"], on_device[1].reduce({"b": grad})["b"])
        want = alone.reduce({"b": grad})["b"]
        got = mixed.reduce({"e": torch.ones(workers, 3, 0), "b": grad})
        # The empty tensor changes nothing about its neighbour's average.
        assert torch.equal(got["b"], want)
        assert got["e"].shape == (3, 0)


# -- bit packing ----------------------------------------------------------------------------
def test_pack_bits_at_eight_bits_returns_a_copy() -> None:
    codes = torch.arange(16, dtype=torch.uint8).reshape(2, 8)
    packed = pack_bits(codes, 8)
    assert torch.equal(packed, codes)
    assert packed is not codes
    assert packed.untyped_storage().data_ptr() != codes.untyped_storage().data_ptr()
    packed[0, 0] = 99  # writing the result leaves the input alone
    assert int(codes[0, 0]) == 0


@pytest.mark.parametrize("bits", [1, 2, 3, 5, 7, 8])
@pytest.mark.parametrize("bad", ["high", "negative"])
def test_pack_bits_refuses_codes_out_of_range(bits: int, bad: str) -> None:
    codes = torch.zeros(3, 10, dtype=torch.int64)
    value = (1 << bits) if bad == "high" else -1
    codes[1, 4] = value
    with pytest.raises(ValueError) as info:
        pack_bits(codes, bits)
    assert str(info.value) == (
        f"`codes` must lie in [0, {(1 << bits) - 1}] for bits={bits}, got {value}"
    )
    codes[1, 4] = (1 << bits) - 1  # the largest code packs and round-trips
    assert torch.equal(unpack_bits(pack_bits(codes, bits), bits, 10), codes.to(torch.uint8))


def test_pack_bits_refuses_float_codes_and_bad_widths() -> None:
    with pytest.raises(TypeError, match=r"`codes` must be an integer or bool tensor, got torch.float32"):
        pack_bits(torch.ones(4), 2)
    with pytest.raises(ValueError, match=r"`bits` must be in \[1, 8\], got 9"):
        pack_bits(torch.ones(4, dtype=torch.uint8), 9)
