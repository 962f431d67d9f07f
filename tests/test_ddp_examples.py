"""The DDP examples, run the way users run them: torchrun with 2 CPU processes (gloo)."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

import pytest

import gradzip
import integrations_launch as launch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def torchrun(script: str, *args: str) -> str:
    """``torchrun --standalone --nproc-per-node 2 examples/<script> <args>``; returns stdout."""
    return launch.torchrun(EXAMPLES / script, *args, timeout=240.0)


def bytes_line(out: str) -> tuple[int, int]:
    match = re.search(r"payload (\d+) vs dense (\d+)", out)
    assert match, out
    return int(match.group(1)), int(match.group(2))


def load_example(name: str) -> ModuleType:
    return launch.load_script(EXAMPLES / f"{name}.py", f"example_{name}")


@pytest.mark.slow
def test_train_ddp_with_torchrun_and_resume(tmp_path: Path) -> None:
    args = ("--compressor", "powersgd:rank=2", "--steps", "5", "--checkpoint-dir", str(tmp_path))
    out = torchrun("train_ddp.py", *args)
    assert "compressor powersgd:rank=2 on 2 processes (cpu), 5 steps" in out
    assert re.search(r"final loss \d+\.\d+, test accuracy", out)
    payload, dense = bytes_line(out)
    assert 0 < payload < dense / 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.pt", "rank1.pt"]
    out = torchrun("train_ddp.py", *args)  # each rank resumes from its own file
    assert "resumed from" in out and "at step 5" in out
    assert "5 steps" not in out and ", 10 steps" in out
    payload2, dense2 = bytes_line(out)
    assert dense2 == 2 * dense and payload < payload2 <= 2 * payload + 64


def test_train_ddp_accordion_flag() -> None:
    example = load_example("train_ddp")
    args = example.parse_args(["--compressor", "powersgd:rank=1", "--accordion", "powersgd:rank=4",
                               "--interval", "5"])
    accordion = example.build_compressor(args)
    assert isinstance(accordion, gradzip.Accordion)
    # --compressor is the aggressive level used in steady regimes, --accordion the gentle one.
    assert accordion.steady == gradzip.PowerSGD(matrix_rank=1)
    assert accordion.critical == gradzip.PowerSGD(matrix_rank=4)
    assert accordion.interval == 5
    assert example.build_compressor(example.parse_args(["--compressor", "sign"])) == "sign"
    with pytest.raises(SystemExit):
        example.parse_args(["--steps", "0"])


@pytest.mark.slow
def test_train_ddp_with_accordion_under_torchrun() -> None:
    out = torchrun("train_ddp.py", "--compressor", "powersgd:rank=1", "--accordion",
                   "powersgd:rank=4", "--steps", "12", "--interval", "3")
    assert "steady=powersgd:rank=1,critical=powersgd:rank=4" in out
    payload, dense = bytes_line(out)
    assert 0 < payload < dense


@pytest.mark.slow
def test_lightning_example_trains_and_resumes(tmp_path: Path) -> None:
    pytest.importorskip("lightning", reason="needs lightning (the `integrations` extra)")
    ckpt = str(tmp_path / "digits.ckpt")
    out = torchrun("lightning_ddp.py", "--compressor", "topk:ratio=0.05", "--steps", "6",
                   "--save", ckpt)
    assert "compressor topk:ratio=0.05 on 2 processes, 6 steps" in out
    payload, dense = bytes_line(out)
    assert 0 < payload < dense / 5
    # Every rank takes its own gradzip state back from rank 0's checkpoint file (a rank that
    # got another rank's state would fail the engine's rank check).
    out = torchrun("lightning_ddp.py", "--compressor", "topk:ratio=0.05", "--steps", "10",
                   "--resume", ckpt)
    assert "on 2 processes, 10 steps" in out


@pytest.mark.slow
def test_accelerate_example_accumulates_and_resumes(tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="needs accelerate (the `integrations` extra)")
    args = ("--compressor", "powersgd:rank=2", "--steps", "4", "--accumulation", "2",
            "--checkpoint-dir", str(tmp_path / "ckpt"))
    out = torchrun("accelerate_ddp.py", *args)
    assert "compressor powersgd:rank=2 on 2 processes, 4 steps" in out
    payload, dense = bytes_line(out)
    assert 0 < payload < dense / 5
    out = torchrun("accelerate_ddp.py", *args)
    assert "resumed from" in out and "after 4 steps" in out
    assert "on 2 processes, 8 steps" in out


@pytest.mark.slow
def test_transformers_trainer_example_trains_and_resumes(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="needs transformers (the `integrations` extra)")
    args = ("--compressor", "powersgd:rank=2", "--save-steps", "3", "--output-dir",
            str(tmp_path / "run"))
    out = torchrun("transformers_trainer.py", *args, "--steps", "3")
    assert "compressor powersgd:rank=2 on 2 processes, 3 steps" in out
    payload, dense = bytes_line(out)
    assert 0 < payload < dense / 2
    # Every rank's hook state is in the checkpoint folder, beside the Trainer's own files.
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoint-3").glob("gradzip_state_*"))
    assert saved == ["gradzip_state_rank0.pt", "gradzip_state_rank1.pt"]
    out = torchrun("transformers_trainer.py", *args, "--steps", "6", "--resume")
    assert "resumed from" in out and "checkpoint-3" in out and "on 2 processes, 6 steps" in out
    payload2, dense2 = bytes_line(out)
    assert dense2 == 2 * dense  # the counters continue from the checkpoint
