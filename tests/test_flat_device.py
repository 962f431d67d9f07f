"""The flat bucket path with its decisions kept on the device (``decide_on="device"``, what
CUDA tensors take), in one process: the same bits, state and counters as the ordinary host
path, with no host read, on buckets whose tensors sit in another order than the engine's.

The three-process checks (ring summation order, ranks out of step) are in
``tests/test_ddp_flat.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gradzip
from gradzip.comm.simulated import SingleWorker

SHAPES = {"conv.weight": torch.Size([4, 3, 3, 3]), "conv.bias": torch.Size([4]),
          "fc.weight": torch.Size([5, 16]), "fc.bias": torch.Size([5])}
NAMES = list(SHAPES)
#: Two buckets, each laid out in reverse parameter order (as DDP lays out the buckets it
#: rebuilds by readiness), so the message is built from several runs.
BUCKETS = [NAMES[2:][::-1], NAMES[:2][::-1]]
#: Ops that read a device value on the host (a CUDA stall).
HOST_READS = {"aten::item", "aten::_local_scalar_dense", "aten::is_nonzero"}


def _grads(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return {n: torch.randn(s, generator=gen) * 10 for n, s in SHAPES.items()}


class _Bucket:
    """A bucket's flat buffer and its views, in ``names`` order."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.buffer = torch.zeros(sum(SHAPES[n].numel() for n in names))
        self.named, at = {}, 0
        for n in names:
            size = SHAPES[n].numel()
            self.named[n] = self.buffer[at : at + size].view(SHAPES[n])
            at += size


def _run(spec: str, policy: str, decide_on: str, flat: bool) -> tuple[Any, ...]:
    """Six steps of two buckets: a NaN in steps 2 and 4, a finite value whose sum
    overflows in step 3. ``flat``: through the engine's bucket call, else through
    ``reduce`` of the same gradients."""
    engine = gradzip.Engine(SHAPES, spec, collective=SingleWorker(), nonfinite=policy,
                            decide_on=decide_on)
    buckets = [_Bucket(names) for names in BUCKETS]
    layouts = [engine.bucket_layout(b.named, b.buffer) for b in buckets] if flat else []
    out = []
    for step in range(6):
        grads = _grads(step)
        if step in (2, 4):
            grads["conv.weight"].view(-1)[3] = float("nan")
        if step == 3:
            grads["fc.weight"].view(-1)[0] = 3e38 if spec == "none" else 7e4
        for i, bucket in enumerate(buckets):
            for n in bucket.names:
                bucket.named[n].copy_(grads[n])
            if flat:
                engine.reduce_bucket(layouts[i], finish_step=i == 1, step=step)
                out.append(bucket.buffer.clone())
            else:
                got = engine.reduce({n: bucket.named[n] for n in bucket.names},
                                    finish_step=i == 1, step=step, same_layout=True)
                out.append(torch.cat([got[n].reshape(-1) for n in bucket.names]))
    took_flat = all(layout.message is not None for layout in layouts)
    return out, engine.stats, engine.state_dict(), took_flat


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0))
        for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("policy", ["skip", "zero"])
@pytest.mark.parametrize("spec", ["none", "fp16", "bf16"])
def test_device_form_equals_the_host_path(spec: str, policy: str) -> None:
    flat, flat_stats, flat_state, took = _run(spec, policy, "device", flat=True)
    host, host_stats, host_state, _ = _run(spec, policy, "host", flat=False)
    # The ordinary device path: the reference for the byte counts, which differ from the
    # host path's in a non-finite step (documented in gradzip.engine.device).
    ordinary, ordinary_stats, ordinary_state, _ = _run(spec, policy, "device", flat=False)
    assert took
    assert _same(flat, host) and _same(flat, ordinary)
    assert flat_stats == ordinary_stats
    assert flat_state == ordinary_state
    assert {k: host_stats[k] for k in ("steps", "skipped_steps")} == \
        {k: flat_stats[k] for k in ("steps", "skipped_steps")}
    # Step 3 overflows only in fp16 (one worker: the fp32 and bf16 sums stay finite).
    assert host_stats["skipped_steps"] == (3 if spec == "fp16" else 2)


@pytest.mark.parametrize("spec", ["none", "fp16"])
def test_device_form_equals_the_host_path_on_clean_steps(spec: str) -> None:
    engines = [gradzip.Engine(SHAPES, spec, collective=SingleWorker(), decide_on=d)
               for d in ("device", "host")]
    buckets = [[_Bucket(names) for names in BUCKETS] for _ in engines]
    layouts = [[e.bucket_layout(b.named, b.buffer) for b in bs]
               for e, bs in zip(engines, buckets, strict=True)]
    for step in range(3):
        grads = _grads(step)
        for engine, bs, ls in zip(engines, buckets, layouts, strict=True):
            for i, (bucket, layout) in enumerate(zip(bs, ls, strict=True)):
                for n in bucket.names:
                    bucket.named[n].copy_(grads[n])
                engine.reduce_bucket(layout, finish_step=i == 1, step=step)
        for mine, ref in zip(buckets[0], buckets[1], strict=True):
            assert torch.equal(mine.buffer, ref.buffer)
    assert engines[0].stats == engines[1].stats
    assert all(layout.message is not None for layout in layouts[0])
    assert all(layout.message is None for layout in layouts[1])
    assert all(len(layout.runs) > 1 for layout in layouts[0])


def test_device_form_reads_nothing_on_the_host() -> None:
    engine = gradzip.Engine(SHAPES, "fp16", collective=SingleWorker(), decide_on="device")
    bucket = _Bucket(BUCKETS[0])
    layout = engine.bucket_layout(bucket.named, bucket.buffer)
    engine.reduce_bucket(layout, finish_step=True)  # the message is built once

    def profiled(decide_on: str) -> set[str]:
        engine.decide_on = decide_on
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            engine.reduce_bucket(layout, finish_step=False)
            engine.reduce_bucket(layout, finish_step=True)
        return {e.name for e in prof.events()}

    assert profiled("device") & HOST_READS == set()
    assert layout.message is not None
    assert profiled("auto") & HOST_READS  # on the CPU, "auto" takes the host form
    assert engine.stats["steps"] == 3 and engine.stats["skipped_steps"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_one_pass_flags_match_the_per_tensor_tests(dtype: torch.dtype) -> None:
    from gradzip.engine.deferred import any_nonfinite, finite_rows_at_once, nonfinite_flag
    from gradzip.ops.finite import finite_rows

    big = torch.finfo(dtype).max
    cases = {"finite": [1.0, -2.0], "extremes": [big, -big], "nan": [float("nan"), 1.0],
             "inf": [float("inf"), 0.0], "-inf": [-float("inf"), 3.0],
             "both": [float("inf"), -float("inf")], "zeros": [0.0, -0.0]}
    for name, values in cases.items():
        x = torch.tensor(values, dtype=dtype)
        expected = not bool(torch.isfinite(x).all())
        assert bool(nonfinite_flag(x)) == expected, name
        # Several tensors of mixed dtypes, one of them empty.
        parts = [torch.ones(3), x, torch.empty(0), torch.full((2, 2), 5.0, dtype=dtype)]
        assert bool(any_nonfinite(parts, x.device)) == expected, name
    rows = torch.randn(3, 4, 5)
    rows[1, 2, 3] = float("nan")
    tensors = [rows, torch.randn(3, 7), torch.empty(3, 0)]
    assert torch.equal(finite_rows_at_once(tensors, 3), finite_rows(tensors, 3))
    assert finite_rows_at_once(tensors, 3).tolist() == [True, False, True]
