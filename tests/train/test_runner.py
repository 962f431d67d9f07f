"""The experiment runner: configuration, simulated training, simulator == real processes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gradzip import NoCompression
from gradzip.comm.base import allreduce_wire_bytes
from gradzip.comm.header import rider_bytes
from gradzip.train.config import RunConfig, resolve_config
from gradzip.train.data import shard_indices
from gradzip.train.plots import critical_spans
from gradzip.train.runner import run
from gradzip.train.schedules import lr_at, milestone_epochs
from gradzip.train.steppers import SimStepper
from gradzip.train.tasks import TASKS, get_task

TINY = dict(task="digits", workers=2, epochs=1, limit_train=200)


def tiny(tmp_path: Path, name: str = "run", **kw: object) -> RunConfig:
    return RunConfig(**{**TINY, "out": str(tmp_path / name), **kw})  # type: ignore[arg-type]


# -- configuration ----------------------------------------------------------------------
def test_resolve_fills_task_defaults_and_milestone_fractions(tmp_path: Path) -> None:
    cfg = resolve_config(RunConfig(task="digits", out=str(tmp_path), epochs=20))
    d = TASKS["digits"].defaults
    assert (cfg.model, cfg.batch_size, cfg.lr, cfg.momentum) == (d.model, d.batch_size, d.lr,
                                                                 d.momentum)
    assert cfg.launcher == "sim"
    assert milestone_epochs(replace(cfg, milestones=(0.5, 0.75))) == [10.0, 15.0]
    assert milestone_epochs(replace(cfg, milestones=(0.5, 15.0))) == [10.0, 15.0]
    assert resolve_config(cfg) == cfg  # idempotent


def test_config_round_trips_through_plain_data(tmp_path: Path) -> None:
    cfg = resolve_config(tiny(tmp_path, accordion_batch=(32, 64), milestones=(0.5,)))
    again = RunConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and again.result_key() == cfg.result_key()
    with pytest.raises(ValueError, match="run options must be among"):
        RunConfig.from_dict({"nosuch": 1})


def test_torchrun_environment_selects_procs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    cfg = resolve_config(tiny(tmp_path))
    assert cfg.launcher == "procs" and cfg.workers == 3
    with pytest.raises(ValueError, match="under torchrun"):
        resolve_config(tiny(tmp_path, launcher="sim"))


# -- data flow --------------------------------------------------------------------------
def test_worker_shards_are_disjoint_and_reshuffled(tmp_path: Path) -> None:
    cfg = resolve_config(tiny(tmp_path, workers=3))
    task = get_task("digits")
    data = task.load(cfg)
    n = len(data.train)
    e0 = [set(shard_indices(n, 3, r, 0, cfg.seed).tolist()) for r in range(3)]
    assert not (e0[0] & e0[1]) and not (e0[1] & e0[2]) and not (e0[0] & e0[2])
    assert shard_indices(n, 3, 0, 1, cfg.seed).tolist() != sorted(e0[0])
    batches = task.batches(data, cfg, 3, 0, 0)
    assert len(batches) == task.steps_per_epoch(data, cfg, 3)


def test_sim_step_with_none_is_the_gradient_of_the_global_batch(tmp_path: Path) -> None:
    cfg = resolve_config(tiny(tmp_path, workers=3))
    task = get_task("digits")
    data = task.load(cfg)
    model = task.build_model(cfg, data)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepper = SimStepper(model, task, NoCompression(), cfg, opt, torch.device("cpu"))
    batches = [task.batches(data, cfg, 3, r, 0)[0] for r in range(3)]
    stepper.step([[b] for b in batches], [None] * 3)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    F.cross_entropy(model(x), y).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-6)


def test_sim_run_is_deterministic_and_leaves_global_state(tmp_path: Path) -> None:
    rng_before = torch.random.get_rng_state()
    threads = torch.get_num_threads()
    a = run(tiny(tmp_path, "a", compressor="topk:ratio=0.05"))
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    assert torch.get_num_threads() == threads
    b = run(tiny(tmp_path, "b", compressor="topk:ratio=0.05"))
    c = run(tiny(tmp_path, "c", compressor="topk:ratio=0.05", seed=1))
    assert a["final_test_loss"] == b["final_test_loss"]
    assert a["bytes_sent_per_worker"] == b["bytes_sent_per_worker"]
    assert c["final_test_loss"] != a["final_test_loss"]


def test_metrics_follow_the_schedule_and_byte_counts(tmp_path: Path) -> None:
    cfg = tiny(tmp_path, epochs=4, milestones=(0.5,), warmup_epochs=1.0)
    summary = run(cfg)
    rows = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    resolved = resolve_config(cfg)
    spe = summary["steps"] // 4
    for r in rows:
        # The last step of epoch e ran at fractional epoch e - 1/spe.
        want = lr_at(r["epoch"] - 1 / spe, base_lr=resolved.lr, warmup_epochs=1.0,
                     milestones=[2.0], workers=2)
        assert r["lr"] == pytest.approx(want)
    assert sum(r["epoch_wire_bytes"] for r in rows) == summary["bytes_sent_per_worker"]
    # `none` sends the dense all-reduce plus the call header riding in it (one call a step).
    header = summary["rounds"] * allreduce_wire_bytes(rider_bytes(torch.float32, 2, summed=True), 2)
    assert summary["bytes_sent_per_worker"] == summary["dense_bytes_per_worker"] + header
    assert 0.999 < summary["compression"] < 1.0


def test_lm_clips_the_averaged_gradient(tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("\n".join(["a b c d e f g h"] * 40) + "\n")
    summary = run(RunConfig(task="lm", data=str(text), workers=2, epochs=1, batch_size=2,
                            bptt=5, model="lstm:embed=8,hidden=8,layers=1",
                            compressor="powersgd:rank=1", out=str(tmp_path / "lm")))
    assert math.isfinite(summary["final_perplexity"])
    assert summary["config"]["clip"] == TASKS["lm"].defaults.clip


def test_critical_spans_merge_adjacent_epochs() -> None:
    rows = [{"epoch": e, "critical_fraction": f} for e, f in
            [(1, 1.0), (2, 1.0), (3, 0.5), (4, 0.0), (5, 0.2), (6, 0.0)]]
    assert critical_spans(rows) == [(0.0, 2.0, 1.0), (2.0, 3.0, 0.5), (4.0, 5.0, 0.2)]
    assert critical_spans([{"epoch": 1, "batch_critical_fraction": 1.0}]) == [(0.0, 1.0, 1.0)]
    assert critical_spans([{"epoch": 1, "accuracy": 0.5}]) == []


# -- simulator == real processes --------------------------------------------------------
PARITY = [
    pytest.param({"compressor": "none"}, id="none"),
    pytest.param({"compressor": "topk:ratio=0.1"}, id="topk"),
    pytest.param({"compressor": "powersgd:rank=1", "accordion": "powersgd:rank=4",
                  "interval_epochs": 0.5, "epochs": 2}, id="accordion"),
    pytest.param({"compressor": "none", "accordion_batch": (32, 64), "interval_epochs": 0.5,
                  "epochs": 2}, id="accordion-batch"),
    pytest.param({"compressor": "topk:ratio=0.1", "dense_1d": True, "error_feedback": False},
                 id="topk-dense-1d-no-feedback"),
]


@pytest.mark.slow
@pytest.mark.parametrize("extra", PARITY)
def test_sim_and_procs_launchers_agree(tmp_path: Path, extra: dict) -> None:
    sim = run(tiny(tmp_path, "sim", launcher="sim", **extra))
    procs = run(tiny(tmp_path, "procs", launcher="procs", timeout=300, **extra))
    for key in ("final_accuracy", "bytes_sent_per_worker", "dense_bytes_per_worker", "steps",
                "rounds", "accordion_counts", "batch_counts"):
        assert sim.get(key) == procs.get(key), key
    assert sim["final_test_loss"] == pytest.approx(procs["final_test_loss"], rel=1e-5)
    assert sim["launcher"] == "sim" and procs["launcher"] == "procs"
    assert (tmp_path / "procs" / "summary.json").exists()


@pytest.mark.slow
def test_gradzip_train_under_torchrun_matches_the_simulator(tmp_path: Path) -> None:
    """Each torchrun process is one worker; rank 0 writes the summary the simulator would."""
    out = tmp_path / "torchrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "gradzip", "train", "--task", "digits", "--epochs", "1", "--limit-train",
           "200", "--compressor", "topk:ratio=0.1", "--out", str(out), "--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    sim = run(tiny(tmp_path, "sim", launcher="sim", compressor="topk:ratio=0.1"))
    assert summary["launcher"] == "procs" and summary["workers"] == 2
    for key in ("final_accuracy", "bytes_sent_per_worker", "dense_bytes_per_worker", "steps"):
        assert summary[key] == sim[key], key
    assert summary["final_test_loss"] == pytest.approx(sim["final_test_loss"], rel=1e-5)


@pytest.mark.slow
def test_sim_and_procs_agree_with_batchnorm(tmp_path: Path, fake_cifar: Path) -> None:
    """BatchNorm statistics follow worker 0 in the simulator, as DDP's buffer broadcast does."""
    data = fake_cifar
    kw = dict(task="cifar10", data=str(data), cache_dir=str(tmp_path / "cache"), workers=2,
              epochs=2, batch_size=4, model="resnet8:width=4", compressor="powersgd:rank=2",
              threads=1)
    sim = run(RunConfig(out=str(tmp_path / "sim"), launcher="sim", **kw))  # type: ignore[arg-type]
    procs = run(RunConfig(out=str(tmp_path / "procs"), launcher="procs", timeout=300, **kw))  # type: ignore[arg-type]
    assert sim["final_test_loss"] == pytest.approx(procs["final_test_loss"], rel=1e-4)
    assert sim["bytes_sent_per_worker"] == procs["bytes_sent_per_worker"]
