"""The DDP communication hook in real gloo process groups (2 processes, CPU).

Starting processes is what costs time, so one group runs every scenario
(``ddp_scenarios.main_group``) and a second, fresh group resumes from its checkpoints; the
tests below check the results one by one.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
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
from ddp_helpers import ALL_SPECS, spawn, trees_equal
from ddp_scenarios import (
    BUILTIN_START,
    BUILTIN_STEPS,
    RESUME_AT,
    RESUME_SPECS,
    RESUME_TOTAL,
    SIM_SPECS,
    main_group,
    resume_group,
)
from gradzip import TopK
from gradzip.comm.header import rider_bytes

WORLD = 2
BUCKET_LABELS = ("one", "tiny")


shared_launch.register(WORLD, "ddp_main", main_group, with_folder=Path, threads=1)


@pytest.fixture(scope="module")
def main(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    # Launched with the other modules' workers of this world size (see shared_launch).
    return shared_launch.results(WORLD, "ddp_main", tmp_path_factory)


@pytest.fixture(scope="module")
def resumed(main: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
            ) -> list[dict[str, Any]]:
    """Fresh processes of their own, resuming from the files the main group wrote."""
    folder = shared_launch.folder(WORLD, "ddp_main")
    return spawn(resume_group, WORLD, tmp_path_factory.mktemp("ddp-resume"), folder)


# -- no processes -------------------------------------------------------------------------------
def test_register_rejects_a_model_that_is_not_ddp() -> None:
    with pytest.raises(TypeError, match="`ddp_model` must be a torch.nn.parallel.DistributedDataParallel, got Linear"):
        gradzip.ddp.register(nn.Linear(2, 2), "none")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"compressor": "nope"}, ValueError, "`spec` must name one of"),
        ({"compressor": "topk:ratio=2"}, ValueError, r"`ratio` must be in \(0, 1\], got 2"),
        ({"nonfinite": "ignore"}, ValueError, "`nonfinite` must be"),
        ({"error_feedback": 1}, TypeError, "`error_feedback` must be a bool or None, got 1"),
        ({"optimizer": "sgd"}, TypeError, "`optimizer` must be a torch.optim.Optimizer, got str"),
        ({"process_group": 0}, TypeError, "`process_group` must be a torch.distributed.ProcessGroup"),
    ],
)
def test_make_hook_validates_its_arguments(kwargs: dict[str, Any], error: type, pattern: str) -> None:
    args = {"compressor": "none", **kwargs}
    with pytest.raises(error, match=pattern):
        gradzip.ddp.make_hook(nn.Linear(2, 2), **args)


@pytest.mark.parametrize(
    ("params", "error", "pattern"),
    [
        (42, TypeError, "`model_or_named_params` must be a module"),
        ([("w", 3)], TypeError, r"must hold \(name, parameter\) pairs, got \('w', 3\)"),
        (nn.ReLU(), ValueError, "at least one trainable parameter"),
    ],
)
def test_make_hook_validates_the_parameters(params: Any, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        gradzip.ddp.make_hook(params, "none")


def test_state_made_before_the_process_group_defers_the_engine() -> None:
    model = nn.Linear(3, 2)
    state, hook = gradzip.ddp.make_hook(model, "topk:ratio=0.5")
    assert hook is gradzip.ddp.gradzip_hook
    assert state.stats["steps"] == 0 and state.stats["levels"] is None
    pending = {"format_version": 1, "step": 7}
    state.load_state_dict(pending)  # kept until the engine exists
    assert state.state_dict() == pending
    with pytest.raises(RuntimeError, match="process group"):
        _ = state.engine
    with pytest.raises(KeyError, match="not among the 2 parameters"):
        state.name_of(torch.zeros(4))
    assert state.name_of(model.weight) == "weight"


def test_state_prints_what_it_is_without_a_process_group() -> None:
    """Before ``init_process_group`` the state prints its compressor and says the engine is
    not built yet (a checkpoint loaded then: at which step), never a step count it does not
    have; printing never waits for a step or refuses inside one."""
    state, _ = gradzip.ddp.make_hook(nn.Linear(3, 2), "topk:ratio=0.5", overlap=False)
    text = repr(state)
    assert text == str(state) == (
        "GradzipHookState(compressor='topk:ratio=0.5', parameters=2, overlap=False, "
        "engine=None (built at the first bucket, once the process group exists))")
    state.load_state_dict({"format_version": 1, "step": 7})
    assert repr(state).endswith(
        "engine=None (built with the process group; a checkpoint at step 7 waits to be loaded))")
    assert repr(state.gathered()) == f"GatheredState({state!r})"
    # Inside a step on the thread that runs it, reading the state is refused; printing is not.
    state._gate.open()
    state._hook_thread = threading.get_ident()
    assert repr(state).startswith("GradzipHookState(compressor='topk:ratio=0.5'")
    state._gate.close()


class _Leveled(TopK):
    """A compressor that reports levels, as an Accordion does."""

    def report(self, state: Mapping[str, Any]) -> dict[str, Any]:
        return {**super().report(state), "levels": {"all": self.ratio}}


def test_single_process_group_stats_levels_and_gathered_state(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1, timeout=timedelta(seconds=60))
    try:
        model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))
        ddp = DDP(model)
        state = gradzip.ddp.register(ddp, _Leveled(ratio=0.1))
        for _ in range(2):
            ddp(torch.randn(3, 6)).sum().backward()
        stats = state.stats
        assert stats["steps"] == 2 and stats["levels"] == {"all": 0.1}
        assert stats["wire_bytes"] == 0 and stats["compression_rate"] is None  # nothing sent
        assert 0 < stats["payload_bytes"] < stats["dense_payload_bytes"]
        gathered = state.gathered().state_dict()
        assert list(gathered) == ["per_rank"] and len(gathered["per_rank"]) == 1
        assert trees_equal(gathered["per_rank"][0], state.state_dict())
        fresh = gradzip.ddp.make_hook(model, _Leveled(ratio=0.1))[0]
        fresh.load_state_dict(gathered)
        assert trees_equal(fresh.state_dict(), state.state_dict())
        with pytest.raises(ValueError, match="must list 1 ranks"):
            fresh.load_state_dict({"per_rank": [gathered, gathered]})
        with pytest.raises(ValueError, match="compressor"):
            gradzip.ddp.make_hook(model, "topk:ratio=0.25")[0].load_state_dict(state.state_dict())
        with pytest.raises(RuntimeError):  # DDP allows one hook
            gradzip.ddp.register(ddp, "none")
    finally:
        dist.destroy_process_group()


# -- one group of processes, many scenarios -------------------------------------------------------
@pytest.mark.slow
def test_none_hook_equals_plain_ddp_exactly(main: list[dict[str, Any]]) -> None:
    for result in main:
        runs = result["parity_plain"]
        for label in BUCKET_LABELS:
            assert torch.equal(runs[f"plain-{label}"]["params"], runs[f"none-{label}"]["params"])
            assert all(runs[f"none-{label}"]["identical"])
        assert torch.equal(runs["plain-tiny"]["params"], runs["none-tiny-view"]["params"])
    assert torch.equal(main[0]["parity_plain"]["none-one"]["params"],
                       main[1]["parity_plain"]["none-one"]["params"])


@pytest.mark.slow
@pytest.mark.parametrize("spec", SIM_SPECS)
@pytest.mark.parametrize("label", BUCKET_LABELS)
def test_deterministic_compressors_equal_the_simulator(
    main: list[dict[str, Any]], spec: str, label: str
) -> None:
    runs = main[0]["parity_simulated"]
    real, sim = runs[f"{spec}-{label}"], runs[f"{spec}-sim"]
    torch.testing.assert_close(real["params"], sim["params"], rtol=0, atol=1e-6)
    assert all(real["identical"])
    assert real["stats"]["steps"] == 4
    if label == "one":  # one reduce per step, as in the simulator: the same messages
        assert real["stats"]["payload_bytes"] == sim["stats"]["payload_bytes"][0]


@pytest.mark.slow
def test_gradient_accumulation_counts_optimizer_steps(main: list[dict[str, Any]]) -> None:
    runs = main[0]["parity_simulated"]
    real, sim = runs["accum"], runs["accum-sim"]
    assert real["stats"]["steps"] == 3  # 3 optimizer steps of 2 micro-batches (one under no_sync)
    assert len(real["losses"]) == 6
    assert all(real["identical"])
    torch.testing.assert_close(real["params"], sim["params"], rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("spec", [*ALL_SPECS, "threshold:lam=0.05"])
@pytest.mark.parametrize("label", BUCKET_LABELS)
def test_every_compressor_trains_in_one_bucket_and_many(
    main: list[dict[str, Any]], spec: str, label: str
) -> None:
    for result in main:
        run = result["every_spec"][(spec, label)]
        assert run["identical"] == [True] * 3
        assert run["finite"]
        assert run["stats"]["steps"] == 3
        assert run["buckets"] == (1 if label == "one" else 6)  # after DDP's rebuild
        assert run["losses"][-1] < run["losses"][0]
        if spec == "none":  # dense bytes, plus the header riding in each bucket's all-reduce
            extra = rider_bytes(torch.float32, 2, summed=True)
            headers = run["stats"]["collective_calls"] * extra  # one collective a bucket
            assert run["stats"]["payload_bytes"] == run["stats"]["dense_payload_bytes"] + headers
        else:
            assert run["stats"]["payload_bytes"] < run["stats"]["dense_payload_bytes"]
            assert run["stats"]["compression_rate"] > 1


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["torch.bfloat16", "torch.float16"])
@pytest.mark.parametrize(
    "spec", ["none", "fp16", "powersgd:rank=2", "topk:ratio=0.1", "threshold:budget=0.05"]
)
def test_low_precision_gradients(main: list[dict[str, Any]], dtype: str, spec: str) -> None:
    for result in main:
        run = result["low_precision"][(dtype, spec)]
        assert run["identical"] == [True] * 3 and run["finite"]
        assert run["param_dtypes"] == [dtype]
        # Error feedback keeps fp32 residuals whatever the gradient dtype.
        assert run["residual_dtypes"] == ([] if spec in ("none", "fp16") else ["torch.float32"])
        assert run["stats"]["steps"] == 3


@pytest.mark.slow
def test_autocast(main: list[dict[str, Any]]) -> None:
    run = main[0]["low_precision"]["autocast"]
    assert run["identical"] == [True] * 3 and run["finite"] and run["stats"]["steps"] == 3


@pytest.mark.slow
def test_grad_scaler_skips_a_nonfinite_step_and_keeps_the_state(main: list[dict[str, Any]]) -> None:
    for result in main:
        run = result["grad_scaler"]
        checks = run["checks"]
        for step in (2, 3):  # Inf in the last bucket only; Inf everywhere
            c = checks[step]
            assert not c["grads_finite"]
            assert c["params_kept"]
            assert c["scale_after"] == c["scale_before"] / 2
            assert c["residuals_kept"] and c["compressor_state_kept"]
        for step in (0, 1, 4):
            c = checks[step]
            assert c["grads_finite"] and not c["params_kept"] and not c["residuals_kept"]
            assert c["scale_after"] == c["scale_before"]
        assert [checks[s]["skipped_steps"] for s in range(5)] == [0, 0, 1, 2, 2]
        assert [checks[s]["engine_step"] for s in range(5)] == [1, 2, 3, 4, 5]
        assert all(run["identical"]) and run["finite"]


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["powersgd:rank=2", "topk:ratio=0.1", "threshold:budget=0.05"])
@pytest.mark.parametrize("label", BUCKET_LABELS)
def test_find_unused_parameters(main: list[dict[str, Any]], spec: str, label: str) -> None:
    for result in main:
        run = result["unused_parameters"][(spec, label)]
        assert run["identical"] == [True] * 3 and run["finite"]
        assert run["unused_kept"]  # zeros in the bucket: never moves
        assert run["odd_trained"]  # used on rank 1 only: averaged with rank 0's zeros
        assert run["steps"] == 3


@pytest.mark.slow
def test_against_builtin_powersgd_hook(main: list[dict[str, Any]]) -> None:
    """Same rank, model and data; the built-in needs one bucket (it deadlocks on gloo with
    more) and start_powerSGD_iter >= 2.

    Bytes are payloads summed over the run on one rank: for the built-in, every tensor it
    hands to ``dist.all_reduce`` (counted by wrapping that function, and equal to the formula:
    the whole bucket in the 2 warm-up steps, then uncompressed tensors + P + Q); for gradzip,
    ``stats["payload_bytes"]`` (the same P and Q with the dense tensors, from step 0, plus a
    4-byte non-finite flag per bucket).
    """
    run = main[0]["builtin"]
    builtin, ours = run["builtin"], run["gradzip"]
    assert builtin["buckets"] == 1
    assert builtin["bytes_measured"] == builtin["bytes_formula"]
    assert ours["stats"]["payload_bytes"] <= builtin["bytes_measured"]
    assert ours["stats"]["steps"] == BUILTIN_STEPS > BUILTIN_START
    assert all(builtin["identical"]) and all(ours["identical"])
    for name in ("builtin", "gradzip"):
        assert run[name]["eval_loss"] < 0.7 * run["initial_eval_loss"]
    rel = abs(ours["eval_loss"] - builtin["eval_loss"]) / builtin["eval_loss"]
    assert rel < 0.2


# -- fresh processes --------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(("spec", "source"), [*[(s, "rank") for s in RESUME_SPECS],
                                              ("powersgd:rank=2", "all")])
def test_resume_in_fresh_processes_is_bit_exact(
    main: list[dict[str, Any]], resumed: list[dict[str, Any]], spec: str, source: str
) -> None:
    """Per-rank files (and the gathered checkpoint) loaded with weights_only=True into a
    differently initialised model: training continues exactly as if never stopped, from the
    first step after the restore."""
    for rank in range(WORLD):
        first = main[rank]["resume"][spec]
        run = resumed[rank][(spec, source)]
        assert trees_equal(run["loaded"], first["saved"])  # this rank's own state came back
        assert run["loaded"]["step"] == RESUME_AT
        assert torch.equal(run["params"], first["full"]["params"])
        assert run["identical"] == [True] * (RESUME_TOTAL - RESUME_AT)
        assert run["stats"]["steps"] == RESUME_TOTAL
