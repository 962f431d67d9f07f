"""The asynchronous (overlapping) DDP hook against the synchronous one, in real gloo groups.

One group of 2 processes runs every scenario (:func:`async_group`); the tests check its
results. The synchronous hook (``overlap=False``) is the reference: the asynchronous one must
give the same parameters and counters bit for bit, with 1 to 16 buckets and every compressor,
under ``no_sync``, unused parameters, a static graph, and DDP's bucket rebuild (the first step
runs in DDP's initial layout, the later ones in one bucket per parameter).
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip.ddp
import shared_launch
from ddp_helpers import (
    ALL_SPECS,
    TINY_BUCKET_MB,
    batch,
    chain,
    replicas_identical,
    train_ddp,
)
from ddp_scenarios import train_branchy
from gradzip import TopK
from gradzip.compressors.base import StepContext
from gradzip.ddp.hook import runs_inline
from gradzip.spec import compressor_from_spec

WORLD = 2
ACCORDION = "accordion(steady=topk:ratio=0.05,critical=topk:ratio=0.2,interval=1)"
SPECS = (*ALL_SPECS, ACCORDION)
BUCKET_COUNTS = tuple(range(1, 17))
MODES = {"async": {}, "sync": {"overlap": False}}


def _bucket_count(ddp: DDP) -> int:
    return len(ddp.reducer._get_zeros_like_grad_buckets())


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return torch.equal(a["params"], b["params"]) and a["stats"] == b["stats"]


# -- scenarios (run inside the processes) ----------------------------------------------------------
def every_spec_and_bucket_count(rank: int) -> dict[Any, Any]:
    """Every compressor with 1 to 16 buckets, 2 steps (one before DDP's rebuild, one after)."""
    out = {}
    for spec in SPECS:
        for n in BUCKET_COUNTS:
            runs = {mode: train_ddp(rank, spec=spec, steps=2, bucket_cap_mb=TINY_BUCKET_MB,
                                    model=chain(n), hook_kwargs=kwargs)
                    for mode, kwargs in MODES.items()}
            run = runs["async"]
            out[(spec, n)] = {
                "same": _same(run, runs["sync"]),
                "buckets": _bucket_count(run["ddp"]),
                "identical": run["identical"],
                "finite": run["finite"],
                "steps": run["stats"]["steps"],
            }
    return out


def ddp_variants(rank: int) -> dict[str, Any]:
    """no_sync accumulation, unused parameters, static graph, gradients as bucket views."""
    out: dict[str, Any] = {}
    for spec in ("powersgd:rank=2", "topk:ratio=0.1", "threshold:budget=0.05"):
        runs = {mode: train_ddp(rank, spec=spec, steps=3, bucket_cap_mb=TINY_BUCKET_MB,
                                micro_batches=2, hook_kwargs=kwargs)
                for mode, kwargs in MODES.items()}
        out[("no_sync", spec)] = {"same": _same(runs["async"], runs["sync"]),
                                  "steps": runs["async"]["stats"]["steps"],
                                  "identical": runs["async"]["identical"]}
        runs = {mode: train_branchy(rank, spec, TINY_BUCKET_MB, kwargs)
                for mode, kwargs in MODES.items()}
        out[("unused", spec)] = {"same": _same(runs["async"], runs["sync"]),
                                 "steps": runs["async"]["stats"]["steps"],
                                 "identical": runs["async"]["identical"]}
        for name, ddp_kwargs in (("static_graph", {"static_graph": True}),
                                 ("bucket_view", {"gradient_as_bucket_view": True})):
            runs = {mode: train_ddp(rank, spec=spec, steps=3, bucket_cap_mb=TINY_BUCKET_MB,
                                    hook_kwargs=kwargs, **ddp_kwargs)
                    for mode, kwargs in MODES.items()}
            out[(name, spec)] = {"same": _same(runs["async"], runs["sync"]),
                                 "steps": runs["async"]["stats"]["steps"],
                                 "identical": runs["async"]["identical"]}
    return out


def stats_inside_a_step(rank: int) -> dict[str, Any]:
    """``stats`` read from a gradient hook in the middle of the backward pass (when the first
    layer's weight gradient arrives, after every other bucket was handed over): it waits for
    the work in flight, so it equals what the synchronous hook has counted at that moment."""
    out = {}
    for mode, kwargs in MODES.items():
        model = chain(6)
        ddp = DDP(model, bucket_cap_mb=TINY_BUCKET_MB)
        state = gradzip.ddp.register(ddp, "topk:ratio=0.1", **kwargs)
        seen: list[dict[str, Any]] = []

        def read_stats(grad: torch.Tensor, state: Any = state, seen: list[Any] = seen) -> None:
            seen.append(state.stats)

        model[0].weight.register_hook(read_stats)
        for step in range(3):
            x, y = batch(step, rank)
            nn.functional.mse_loss(ddp(x), y).backward()
        out[mode] = [{k: s[k] for k in ("steps", "payload_bytes", "collective_calls")} for s in seen]
    return out


def hook_returns_before_its_collectives(rank: int, folder: Path) -> dict[str, Any]:
    """Rank 1 starts its backward only once rank 0's hook has returned the future of the
    first bucket; that future cannot be complete then (rank 1 has not contributed yet), so the
    hook returned before its collectives ran. The synchronous hook would wait here forever."""
    model = chain(4)
    ddp = DDP(model, bucket_cap_mb=TINY_BUCKET_MB)
    state, _ = gradzip.ddp.make_hook(model, "powersgd:rank=2")
    flag = folder / "first-bucket-handed-over"
    done_at_return: list[bool] = []
    current = {"step": 0}

    def hook(state: Any, bucket: Any) -> Any:
        future = gradzip.ddp.gradzip_hook(state, bucket)
        if not done_at_return and current["step"] == 2:
            done_at_return.append(future.done())
            flag.touch()
        return future

    # DDP checks the annotations against the real types (this module postpones them).
    hook.__annotations__ = {"state": gradzip.ddp.GradzipHookState, "bucket": dist.GradBucket,
                            "return": torch.futures.Future[torch.Tensor]}
    ddp.register_comm_hook(state, hook)
    for step in range(3):  # step 2 runs in the rebuilt layout
        current["step"] = step
        if rank == 1 and step == 2:
            deadline = time.monotonic() + 600  # a safety net only: the flag is the signal
            while not flag.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert flag.exists(), "rank 0 never reached step 2's hook"
        x, y = batch(step, rank)
        nn.functional.mse_loss(ddp(x), y).backward()
    return {"done_at_return": done_at_return, "identical": replicas_identical(model),
            "steps": state.stats["steps"]}


class FailsOnRank1(TopK):
    """Top-k whose exchange raises on rank 1 at step 1: a user compressor that fails."""

    def reduce(self, jobs: Any, state: dict[str, Any], comm: Any, ctx: StepContext) -> None:
        if ctx.step == 1 and 1 in ctx.ranks:
            raise ValueError("injected failure on rank 1")
        super().reduce(jobs, state, comm, ctx)


def _error_of(fn: Any) -> str | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - what each rank saw is the result
        return f"{type(exc).__name__}: {exc}"
    return None


def failures(rank: int) -> dict[str, Any]:
    """Errors inside the hook's work surface on every rank as errors, never as hangs.

    Each case uses its own process group (15 s timeout) so that a broken one stays apart.
    ``raise``: Inf on rank 1 with ``nonfinite="raise"`` (every rank agrees and raises).
    ``one_rank``: a compressor fails on rank 1 only; rank 0, waiting in its collective, fails
    when rank 1's process is gone, or at the group's timeout.
    """
    out: dict[str, Any] = {}
    for mode, kwargs in MODES.items():
        group = dist.new_group(timeout=timedelta(seconds=15))
        model = chain(4)
        ddp = DDP(model, bucket_cap_mb=TINY_BUCKET_MB, process_group=group)
        gradzip.ddp.register(ddp, "topk:ratio=0.1", nonfinite="raise", **kwargs)
        errors = []
        for step in range(2):
            x, y = batch(step, rank)
            if step == 1 and rank == 1:
                x[0, 0] = float("inf")
            errors.append(_error_of(lambda x=x, y=y, ddp=ddp: nn.functional.mse_loss(ddp(x), y).backward()))
        out[("raise", mode)] = errors
    group = dist.new_group(timeout=timedelta(seconds=15))
    model = chain(4)
    ddp = DDP(model, bucket_cap_mb=TINY_BUCKET_MB, process_group=group)
    gradzip.ddp.register(ddp, FailsOnRank1(ratio=0.1))
    errors = []
    for step in range(2):
        x, y = batch(step, rank)
        errors.append(_error_of(lambda x=x, y=y: nn.functional.mse_loss(ddp(x), y).backward()))
    out["one_rank"] = errors
    return out


def async_group(rank: int, world: int, folder: Path) -> dict[str, Any]:
    return {
        "every": every_spec_and_bucket_count(rank),
        "variants": ddp_variants(rank),
        "stats_inside": stats_inside_a_step(rank),
        "early": hook_returns_before_its_collectives(rank, folder),
        "failures": failures(rank),  # last: rank 1 leaves while rank 0 still fails
    }


# -- the tests ---------------------------------------------------------------------------------------
# Last in its launch: its final scenario has rank 1 leave while rank 0 still fails.
shared_launch.register(WORLD, "ddp_async", async_group, with_folder=Path, threads=1, last=True)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    # Launched with the other modules' workers of this world size (see shared_launch).
    return shared_launch.results(WORLD, "ddp_async", tmp_path_factory)


def test_overlap_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="`overlap` must be a bool, got 1"):
        gradzip.ddp.make_hook(nn.Linear(2, 2), "none", overlap=1)  # type: ignore[arg-type]


def test_an_error_before_the_work_is_queued_fails_that_step(tmp_path: Path) -> None:
    """A bucket whose parameter the state does not know (a state built from another model):
    the error reaches DDP through the future, and the state refuses later buckets."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1, timeout=timedelta(seconds=60))
    try:
        model = chain(3)
        ddp = DDP(model)
        state, hook = gradzip.ddp.make_hook(chain(3), "none")
        ddp.register_comm_hook(state, hook)
        x, y = batch(0, 0)
        with pytest.raises(RuntimeError, match="not among the 3 parameters"):
            nn.functional.mse_loss(ddp(x), y).backward()
        assert isinstance(state._failure, KeyError)
        state.wait()  # nothing left in flight
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS)
def test_every_compressor_with_1_to_16_buckets_equals_the_synchronous_hook(
    results: list[dict[str, Any]], spec: str
) -> None:
    for result in results:
        for n in BUCKET_COUNTS:
            run = result["every"][(spec, n)]
            assert run["buckets"] == n
            assert run["same"], (spec, n)  # parameters and every counter, bit for bit
            assert run["identical"] == [True, True] and run["finite"]
            assert run["steps"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["no_sync", "unused", "static_graph", "bucket_view"])
@pytest.mark.parametrize("spec", ["powersgd:rank=2", "topk:ratio=0.1", "threshold:budget=0.05"])
def test_ddp_variants_equal_the_synchronous_hook(
    results: list[dict[str, Any]], variant: str, spec: str
) -> None:
    for result in results:
        run = result["variants"][(variant, spec)]
        assert run["same"]
        assert run["identical"] == [True] * 3
        assert run["steps"] == 3  # optimizer steps, also with two micro-batches per step


@pytest.mark.slow
def test_stats_inside_a_step_wait_for_the_work_in_flight(results: list[dict[str, Any]]) -> None:
    for result in results:
        seen = result["stats_inside"]
        assert len(seen["async"]) == 3
        assert seen["async"] == seen["sync"]
        assert [s["steps"] for s in seen["async"]] == [0, 1, 2]  # read before each step ends
        # Step 0 runs in DDP's initial layout (one bucket, handed over after this hook).
        assert seen["async"][0]["payload_bytes"] == 0
        assert 0 < seen["async"][1]["payload_bytes"] < seen["async"][2]["payload_bytes"]


@pytest.mark.slow
def test_the_hook_returns_before_its_collectives_complete(results: list[dict[str, Any]]) -> None:
    early = results[0]["early"]
    assert early["done_at_return"] == [False]
    for result in results:
        assert result["early"]["identical"] and result["early"]["steps"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_an_agreed_error_raises_on_every_rank(results: list[dict[str, Any]], mode: str) -> None:
    for result in results:
        first, second = result["failures"][("raise", mode)]
        assert first is None
        assert second is not None and "NaN or Inf at step 1" in second


@pytest.mark.slow
def test_an_error_on_one_rank_becomes_an_error_on_every_rank(results: list[dict[str, Any]]) -> None:
    for result in results:
        assert result["failures"]["one_rank"][0] is None
    assert "injected failure on rank 1" in results[1]["failures"]["one_rank"][1]
    assert results[0]["failures"]["one_rank"][1] is not None  # its peer left: not a hang


@pytest.mark.parametrize(
    ("backend", "device", "device_decisions", "expected"),
    [
        ("nccl", "cuda:0", True, True),
        ("NCCL", "cuda", True, True),
        ("cpu:gloo,cuda:nccl", "cuda:1", True, True),
        ("nccl", "cuda:0", False, False),  # a compressor that reads the host keeps the thread
        ("gloo", "cuda:0", True, False),  # gloo's collectives block the calling thread
        ("gloo", "cpu", True, False),
        ("cpu:gloo,cuda:gloo", "cuda:0", True, False),
        ("cuda:nccl,cpu:gloo", "cpu", True, False),
        ("nccl", "cpu", True, False),
        ("mpi", "cuda:0", True, False),
    ],
)
def test_inline_only_on_cuda_with_nccl_and_device_decisions(
    backend: str, device: str, device_decisions: bool, expected: bool
) -> None:
    assert runs_inline(backend, torch.device(device), device_decisions) is expected


def test_device_deciding_compressors_are_the_inline_ones() -> None:
    cuda = torch.device("cuda:0")
    for spec in ("none", "fp16", "bf16", "topk:ratio=0.1", "randk:ratio=0.1", "qsgd", "sign",
                 "powersgd:rank=2"):
        assert runs_inline("nccl", cuda, compressor_from_spec(spec).device_decisions), spec
    for spec in ("threshold:budget=0.05", "threshold:lam=1.0"):
        assert not runs_inline("nccl", cuda, compressor_from_spec(spec).device_decisions), spec
