"""The compiled kernels (the ``fast`` extra) give exactly the bits of the NumPy and torch paths."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import gradzip
from gradzip.compressors import qsgd as qsgd_module
from gradzip.compressors.base import Job, StepContext
from gradzip.compressors.qsgd import QSGD
from gradzip.ops import jit, select
from gradzip.ops.bits import pack_bits, unpack_bits

pytestmark = pytest.mark.skipif(not jit.enabled(), reason="the compiled kernels need numba (the `fast` extra)")

FAST = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape and a.dtype == b.dtype
        and a.contiguous().numpy().tobytes() == b.contiguous().numpy().tobytes()
    )


def test_the_switch_turns_the_kernels_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADZIP_JIT", "0")
    assert not jit.enabled() and not qsgd_module._jit_usable()
    monkeypatch.setenv("GRADZIP_JIT", "1")
    assert jit.enabled() and qsgd_module._jit_usable()


#: Calls both kernels once, then prints how often Numba compiled them and how often it loaded
#: them from its disk cache.
CACHE_PROBE = """
import numpy as np
from gradzip.ops import _jit_kernels, jit
x = np.linspace(-1, 1, 200, dtype=np.float32)
out = np.empty_like(x)
jit.threshold_split_chunk(x, 0.5, out, np.empty(200, np.int64), np.empty_like(x), 0)
packed = np.arange(2 * 40, dtype=np.uint8).reshape(2, 40) % 16
jit.qsgd_sum(packed, 4, 0, 64, 32, np.ones((2, 2), np.float32), np.zeros(2, np.float32), 2)
kernels = (_jit_kernels.split, _jit_kernels.qsgd)
print(sum(sum(k.stats.cache_misses.values()) for k in kernels),
      sum(sum(k.stats.cache_hits.values()) for k in kernels))
"""


def test_a_later_process_loads_the_kernels_from_the_disk_cache() -> None:
    """Compiling QSGD's kernel takes seconds of CPU: every process after the first (a spawned
    worker, a training run) must load both kernels from Numba's cache, not compile them."""
    counts = []
    for _ in range(2):  # the first may compile (a fresh checkout) and writes the cache
        done = subprocess.run([sys.executable, "-c", CACHE_PROBE], capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        counts.append(done.stdout.split())
    assert counts[1] == ["0", "2"]  # no compilation, two kernels loaded


@FAST
@given(
    workers=st.integers(1, 8),
    levels=st.integers(1, 63),  # codes of 2 to 7 bits
    bucket_size=st.sampled_from([0, 0, 7, 300, 8192, 9000]),
    numel=st.integers(1, 20000),
    first=st.integers(0, 21),
    tail=st.integers(0, 9),
    parent=st.booleans(),
    exponent=st.integers(-20, 20),
    seed=st.integers(0, 2**31 - 1),
)
@example(workers=1, levels=1, bucket_size=0, numel=1, first=0, tail=0, parent=False, exponent=0, seed=0)
@example(workers=4, levels=8, bucket_size=0, numel=8193, first=5, tail=0, parent=False, exponent=3, seed=1)
def test_qsgd_kernel_equals_unpack_then_decode_sum(
    workers: int, levels: int, bucket_size: int, numel: int, first: int, tail: int, parent: bool,
    exponent: int, seed: int,
) -> None:
    """A tensor at any position of the stream, with codes after it or not, rows cut from a
    wider message (as the gathered messages are) or exactly as long as the codes."""
    gen = torch.Generator().manual_seed(seed)
    q = QSGD(levels=levels, bucket_size=bucket_size)
    buckets, size = q._layout(numel)
    total = first + numel + tail
    codes = torch.randint(0, 2 * levels + 1, (workers, total), generator=gen, dtype=torch.uint8)
    packed = pack_bits(codes, q.bits)
    if parent:  # a slice of rows that hold a header before the codes
        packed = torch.cat([torch.zeros(workers, 13, dtype=torch.uint8), packed], dim=1)[:, 13:]
    norms = torch.rand(workers, buckets, generator=gen) * 10.0**exponent
    want = q._decode_sum(norms, unpack_bits(packed, q.bits, total)[:, first : first + numel], numel, workers + 1)
    got, top = jit.qsgd_sum(
        packed.numpy(), q.bits, first, numel, size, (norms / levels).numpy(),
        qsgd_module._rank_sum(norms).numpy(), workers + 1,
    )
    assert _same_bits(torch.from_numpy(got), want)
    assert top == int(codes[:, first : first + numel].max())


def _qsgd_reduce(spec: str, grads: dict[str, torch.Tensor], workers: int) -> list[torch.Tensor]:
    ctx = StepContext(step=3, ranks=tuple(range(workers)), world_size=workers)
    jobs = [Job(name, g.clone()) for name, g in grads.items()]
    compressor = gradzip.compressor_from_spec(spec)
    shapes = {name: g.shape[1:] for name, g in grads.items()}
    compressor.reduce(jobs, compressor.init_state(shapes), gradzip.SimulatedGroup(workers), ctx)
    return [job.averaged for job in jobs]


@pytest.mark.parametrize("spec", ["qsgd", "qsgd:levels=1", "qsgd:levels=40,bucket_size=100"])
def test_qsgd_reduce_is_the_same_with_and_without_the_kernel(
    spec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(5)
    grads = {"a": torch.randn(3, 5, generator=gen), "b": torch.randn(3, 40, 70, generator=gen),
             "c": torch.randn(3, 9001, generator=gen)}
    with_kernel = _qsgd_reduce(spec, grads, 3)
    monkeypatch.setenv("GRADZIP_JIT", "0")
    without = _qsgd_reduce(spec, grads, 3)
    for a, b in zip(with_kernel, without, strict=True):
        assert _same_bits(a, b)


def test_qsgd_kernel_reports_a_code_above_the_levels() -> None:
    codes = torch.full((2, 100), 8, dtype=torch.uint8)
    codes[1, 57] = 31
    _, top = jit.qsgd_sum(
        pack_bits(codes, 5).numpy(), 5, 0, 100, 100, np.ones((2, 1), np.float32),
        np.ones(1, np.float32), 2,
    )
    assert top == 31


def _threshold_split_both(
    x: torch.Tensor, lam: float, monkeypatch: pytest.MonkeyPatch
) -> tuple[tuple, tuple]:
    monkeypatch.setenv("GRADZIP_JIT", "1")
    compiled = select.threshold_split(x, lam)
    monkeypatch.setenv("GRADZIP_JIT", "0")
    plain = select.threshold_split(x, lam)
    monkeypatch.setenv("GRADZIP_JIT", "1")
    return compiled, plain


@FAST
@given(
    rows=st.integers(1, 3),
    numel=st.integers(1, 5000),
    lam=st.sampled_from([1e-30, 0.5, 1.0, 2.5758, 4.0, 1e30]),
    double=st.booleans(),
    specials=st.integers(0, 6),
    seed=st.integers(0, 2**31 - 1),
)
@example(rows=1, numel=33, lam=1.0, double=False, specials=6, seed=0)
def test_threshold_kernel_equals_the_numpy_scan(
    rows: int, numel: int, lam: float, double: bool, specials: int, seed: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chunks of 1000 entries; NaN, infinities, signed zeros and entries exactly at lambda or
    just under it."""
    monkeypatch.setattr(select, "_CHUNK", 1000)
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float64 if double else torch.float32
    x = torch.randn(rows, numel, generator=gen, dtype=dtype) * 2
    kind = np.float64 if double else np.float32
    odd = [float("nan"), float("inf"), -float("inf"), -0.0, lam, -lam,
           float(np.nextafter(kind(lam), kind(0)))]
    pos = torch.randint(0, numel, (specials,), generator=gen)
    for s, p in enumerate(pos.tolist()):
        x[s % rows, p] = odd[s]
    (cv, ci, cr), (pv, pi, pr) = _threshold_split_both(x, lam, monkeypatch)
    assert _same_bits(cr, pr)
    for a, b in zip(cv, pv, strict=True):
        assert _same_bits(a, b)
    for a, b in zip(ci, pi, strict=True):
        assert a.dtype == torch.int64 and torch.equal(a, b)


def test_threshold_compress_is_the_same_with_and_without_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gen = torch.Generator().manual_seed(9)
    grads = {"a": torch.randn(2, 3000, generator=gen), "b": torch.randn(2, 7, generator=gen)}
    ctx = StepContext(step=0, ranks=(0, 1), world_size=2)

    def run() -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        jobs = [Job(name, g.clone()) for name, g in grads.items()]
        compressor = gradzip.compressor_from_spec("threshold:lam=1.5")
        shapes = {name: g.shape[1:] for name, g in grads.items()}
        compressor.reduce(jobs, compressor.init_state(shapes), gradzip.SimulatedGroup(2), ctx)
        return [(job.averaged, job.residual) for job in jobs]

    with_kernel = run()
    monkeypatch.setenv("GRADZIP_JIT", "0")
    for (a, ra), (b, rb) in zip(with_kernel, run(), strict=True):
        assert _same_bits(a, b)
        assert (ra is None) == (rb is None) and (ra is None or _same_bits(ra, rb))


def test_qsgd_compiled_decode_refuses_what_the_unpacking_refuses() -> None:
    """A truncated stream and a code above ``2 * levels`` fail as in the fallback."""
    q = QSGD(levels=8)
    numels = [10, 7]
    norms = [torch.ones(2, 1), torch.ones(2, 1)]
    codes = torch.full((2, 17), 8, dtype=torch.uint8)
    packed = pack_bits(codes, q.bits)
    with pytest.raises(ValueError, match=r"`packed` must hold at least 11 bytes for 17 codes"):
        q._average_compiled(numels, norms, packed[:, :10], 2)
    codes[1, 12] = 17
    with pytest.raises(ValueError, match=r"message codes must lie in \[0, 16\], got 17"):
        q._average_compiled(numels, norms, pack_bits(codes, q.bits), 2)
    assert [a.shape for a in q._average_compiled(numels, norms, packed, 2)] == [(10,), (7,)]
