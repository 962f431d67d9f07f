"""The segment path in one process (a group of one worker), against the host path.

A bucket's gradients as views of one flat buffer, laid out in another order than the engine's
(as DDP lays a bucket out in the order gradients become ready): the segment path
(``decide_on="device"``) must leave the same averages in the bucket, the same residuals,
counters and compression errors as the host path, step after step, a step with a NaN
included. ``tests/test_cuda.py`` runs the same on a GPU, with host synchronisations turned
into errors.
"""

from __future__ import annotations

import math

import pytest
import torch

import gradzip.engine.core
from gradzip import Engine
from gradzip.comm.simulated import SingleWorker

SHAPES = {"conv.weight": (16, 8, 3, 3), "conv.bias": (16,), "fc.weight": (10, 64),
          "fc.bias": (10,), "norm.weight": (1,)}
#: Every segment form (the threshold's with a capacity), and Top-k with the engine sending
#: 1-D tensors dense.
SPECS = ["topk:ratio=0.05", "randk:ratio=0.1", "qsgd", "sign", "threshold:lam=0.05,capacity=0.1",
         "topk:ratio=0.05+dense_1d", "powersgd:rank=2", "powersgd:rank=1+dense_1d"]


def bucket(device: str = "cpu", shapes: dict[str, tuple[int, ...]] | None = None
           ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A flat buffer and its views (``shapes``, default :data:`SHAPES`), the tensors in
    reverse of the engine's order (as DDP lays a bucket out in the order gradients become
    ready)."""
    shapes = SHAPES if shapes is None else shapes
    sizes = {n: math.prod(s) for n, s in shapes.items()}
    buffer = torch.zeros(sum(sizes.values()), device=device)
    views, start = {}, 0
    for name in reversed(list(shapes)):
        views[name] = buffer[start : start + sizes[name]].view(shapes[name])
        start += sizes[name]
    return buffer, views


def run(spec: str, decide_on: str, *, nonfinite: str = "skip", nan_at: int | None = None,
        device: str = "cpu", steps: int = 5, steady: object = None) -> dict[str, object]:
    """``steps`` calls of one bucket per step; ``steady``: a context for steps from the third."""
    spec, *flags = spec.split("+")
    engine = Engine({n: torch.Size(s) for n, s in SHAPES.items()}, spec,
                    collective=SingleWorker(), decide_on=decide_on, nonfinite=nonfinite,
                    dense_1d="dense_1d" in flags)
    buffer, views = bucket(device)
    layout = engine.bucket_layout(views, buffer)
    averages = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        buffer.copy_(torch.randn(buffer.numel(), generator=gen))
        if step == nan_at:
            views["fc.weight"][3, 5] = float("nan")
        if steady is not None and step >= 2:
            with steady:  # type: ignore[attr-defined]
                engine.reduce_bucket(layout, finish_step=True, step=step)
        else:
            engine.reduce_bucket(layout, finish_step=True, step=step)
        averages.append(buffer.detach().cpu().clone())
    state = engine.state_dict()
    return {"averages": torch.stack(averages), "residuals": state["residuals"],
            "stats": engine.stats, "error": engine.compression_error(),
            "segments": layout.segments is not None and layout.segments.calls}


def same(a: dict[str, object], b: dict[str, object]) -> bool:
    ra, rb = a["residuals"], b["residuals"]
    assert isinstance(ra, dict) and isinstance(rb, dict)
    return (torch.equal(a["averages"].nan_to_num(7.0), b["averages"].nan_to_num(7.0))
            and ra.keys() == rb.keys() and all(torch.equal(ra[n].cpu(), rb[n].cpu()) for n in ra)
            and a["stats"] == b["stats"] and a["error"] == b["error"])


@pytest.mark.parametrize("spec", SPECS)
def test_the_segment_path_equals_the_host_path(spec: str) -> None:
    got, want = run(spec, "device"), run(spec, "host")
    assert got["segments"] >= 4 and not want["segments"]  # the first step keeps no residual yet
    assert same(got, want)


#: Counters in which a device decision differs from a host one by design: after a non-finite
#: call the host path sends the header only, the device path the payload.
DEVICE_COUNTS = ("payload_bytes", "wire_bytes", "dense_payload_bytes", "dense_wire_bytes",
                 "collective_calls", "compression_rate")


@pytest.mark.parametrize("nonfinite", ["skip", "zero"])
@pytest.mark.parametrize("spec", SPECS)
def test_a_nan_is_handled_as_on_the_other_paths(
    spec: str, nonfinite: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    got = run(spec, "device", nonfinite=nonfinite, nan_at=2)
    host = run(spec, "host", nonfinite=nonfinite, nan_at=2)
    monkeypatch.setattr(gradzip.engine.core, "segments_apply", lambda *args: False)
    device = run(spec, "device", nonfinite=nonfinite, nan_at=2)
    assert got["segments"] >= 3 and not device["segments"]
    assert same(got, device)  # the ordinary device path: everything alike
    stats = got["stats"]
    assert isinstance(stats, dict) and stats["skipped_steps"] == 1
    host_stats = host["stats"]
    assert isinstance(host_stats, dict)
    got["stats"] = {k: host_stats[k] if k in DEVICE_COUNTS else v for k, v in stats.items()}
    assert same(got, host)
