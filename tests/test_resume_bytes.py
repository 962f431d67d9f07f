"""Byte counters of a DDP run resumed from a checkpoint, with several buckets and with one.

DDP groups parameters into buckets by its initial layout on a fresh module's first step and
by its rebuilt layout (gradient-ready order) from the second step on. Every bucket is one
engine call with its own header, so the first step after a resume, made at the initial
layout, sends the per-call overhead of that layout where the uninterrupted run sent the
rebuilt layout's. What the README's "Resuming a run" states, pinned exactly: the message
counters differ by the difference between one step at each layout; the parameters, step
counts and dense-equivalent counters are equal; with one bucket, everything is equal.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shared_launch
from ddp_helpers import ONE_BUCKET_MB, TINY_BUCKET_MB, mlp, train_ddp

SPECS = ("topk:ratio=0.1", "powersgd:rank=2")
TOTAL, AT = 5, 2
#: Counters of what travelled: they follow the bucket layout.
MESSAGES = ("payload_bytes", "wire_bytes", "collective_calls")
#: Counters that do not: steps, and what a dense fp32 all-reduce of the same tensors costs.
EQUAL = ("steps", "skipped_steps", "dense_payload_bytes", "dense_wire_bytes")


def _runs(rank: int, world: int) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for spec in SPECS:
        for cap in (TINY_BUCKET_MB, ONE_BUCKET_MB):
            full = train_ddp(rank, spec=spec, steps=TOTAL, bucket_cap_mb=cap)
            first = train_ddp(rank, spec=spec, steps=1, bucket_cap_mb=cap)["stats"]
            two = train_ddp(rank, spec=spec, steps=2, bucket_cap_mb=cap)["stats"]
            part = train_ddp(rank, spec=spec, steps=AT, bucket_cap_mb=cap)
            ckpt = {"model": part["model"].state_dict(), "optimizer": part["opt"].state_dict(),
                    "gradzip": part["state"].state_dict()}

            def setup(model: Any, opt: Any, state: Any, ckpt: dict[str, Any] = ckpt) -> None:
                model.load_state_dict(ckpt["model"])
                opt.load_state_dict(ckpt["optimizer"])
                state.load_state_dict(ckpt["gradzip"])

            resumed = train_ddp(rank, spec=spec, steps=TOTAL - AT, start=AT, bucket_cap_mb=cap,
                                model=mlp(seed=99), setup=setup)
            out[spec, cap] = {
                "full": full["stats"], "resumed": resumed["stats"],
                # One step at the initial layout, and one at the rebuilt layout.
                "initial": {k: first[k] for k in MESSAGES},
                "rebuilt": {k: two[k] - first[k] for k in MESSAGES},
                "same_params": bool(torch.equal(full["params"], resumed["params"])),
            }
    return out


shared_launch.register(2, "resume_bytes", _runs, threads=1)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    # Launched with the other modules' workers of this world size (see shared_launch).
    return shared_launch.results(2, "resume_bytes", tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS)
def test_resume_with_several_buckets_differs_by_one_steps_layout_overhead(
    results: list[dict[Any, Any]], spec: str
) -> None:
    for rank_results in results:
        run = rank_results[spec, TINY_BUCKET_MB]
        assert run["same_params"]
        full, resumed = run["full"], run["resumed"]
        for key in EQUAL:
            assert resumed[key] == full[key], key
        # The layouts differ in this model (else this test would pin nothing) ...
        assert run["initial"] != run["rebuilt"]
        # ... and the resumed run made one more step at the initial layout, one fewer at the
        # rebuilt one: exactly that much differs, nothing else.
        for key in MESSAGES:
            shift = run["initial"][key] - run["rebuilt"][key]
            assert resumed[key] - full[key] == shift, (key, resumed[key], full[key], shift)


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS)
def test_resume_with_one_bucket_counts_every_byte_alike(
    results: list[dict[Any, Any]], spec: str
) -> None:
    for rank_results in results:
        run = rank_results[spec, ONE_BUCKET_MB]
        assert run["same_params"]
        assert run["initial"] == run["rebuilt"]
        assert run["resumed"] == run["full"]
