"""The ``gradzip`` command: listing, error handling, one run per task, compare, demo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gradzip.cli import main

EPOCH_KEYS = {
    "kind", "epoch", "step", "lr", "train_loss", "test_loss", "payload_bytes", "wire_bytes",
    "dense_payload_bytes", "dense_wire_bytes", "epoch_wire_bytes", "compression", "rounds",
    "epoch_seconds", "seconds",
}
SUMMARY_KEYS = {
    "bytes_sent_per_worker", "dense_bytes_per_worker", "steps", "wall_seconds", "config",
    "versions", "metric", "compression",
}
QUICK = ["--workers", "2", "--epochs", "1", "--quiet"]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- list -------------------------------------------------------------------------------
def test_list_json_is_valid_and_complete(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "list", "--json")
    assert code == 0
    info = json.loads(out)
    names = {c["name"] for c in info["compressors"]}
    assert {"none", "topk", "threshold", "powersgd", "qsgd", "sign"} <= names
    topk = next(c for c in info["compressors"] if c["name"] == "topk")
    assert {"name": "ratio", "default": 0.01}.items() <= topk["parameters"][0].items()
    assert {t["name"] for t in info["tasks"]} == {"digits", "cifar10", "lm", "logreg"}
    assert "resnet20" in info["models"]
    assert "demo" in info["presets"]


def test_list_text_names_every_compressor(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "list")
    assert code == 0
    for name in ("topk", "powersgd", "threshold", "digits", "cifar10", "digits-quick"):
        assert name in out


# -- errors -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--compressor", "topk:ratio=1.5"], "ratio"),
        (["--compressor", "nosuch"], "compressor"),
        (["--compressor", "topk:ratio"], "key=value"),
        (["--task", "nosuch"], "task"),
        (["--workers", "0"], "workers"),
        (["--model", "resnet8:nosuch=1"], "model"),
        (["--task", "cifar10"], "data"),
        (["--milestones", "a,b"], "milestones"),
        (["--compressor", "powersgd:rank=1", "--accordion", "topk:ratio=0.1"], "accordion"),
        (["--accordion-batch", "64,100"], "accordion-batch"),
        (["--batch-size", "100000"], "batch_size"),
        (["--data", "/nonexistent/file.txt", "--task", "lm"], "data"),
    ],
)
def test_bad_configuration_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], fragment: str
) -> None:
    code, out, err = run_cli(capsys, "train", "--out", str(tmp_path / "run"), *QUICK, *args)
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and fragment in err
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.slow  # starts a process
def test_module_entry_point_errors_without_traceback(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gradzip", "train", "--compressor", "topk:ratio=2", "--out",
         str(tmp_path / "x")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "`ratio` must be in (0, 1], got 2" in proc.stderr


def test_help_has_examples(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("train", "compare", "demo", "list"):
        with pytest.raises(SystemExit) as exc:
            main([command, "--help"])
        assert exc.value.code == 0
        assert "example" in capsys.readouterr().out


def test_bench_delegates_its_arguments(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = []
    fake = type(sys)("gradzip.bench")
    fake.main = lambda argv: seen.append(argv) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "gradzip.bench", fake)
    import gradzip

    monkeypatch.setattr(gradzip, "bench", fake, raising=False)
    assert main(["bench", "micro", "--size", "3"]) == 0
    assert seen == [["micro", "--size", "3"]]


# -- one run per task -------------------------------------------------------------------
def test_train_digits_writes_metrics_and_summary(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    code, stdout, err = run_cli(capsys, "train", "--task", "digits", "--epochs", "1",
                                "--workers", "2", "--compressor", "topk:ratio=0.1",
                                "--out", str(out), "--log-every", "10")
    assert code == 0, err
    assert "final accuracy" in stdout
    records = read_jsonl(out / "metrics.jsonl")
    epochs = [r for r in records if r["kind"] == "epoch"]
    steps = [r for r in records if r["kind"] == "step"]
    assert len(epochs) == 1 and EPOCH_KEYS <= set(epochs[0]) and "accuracy" in epochs[0]
    assert epochs[0]["density"] == pytest.approx(0.1)
    summary = json.loads((out / "summary.json").read_text())
    assert SUMMARY_KEYS | {"final_accuracy"} <= set(summary)
    assert steps and steps[-1]["step"] <= summary["steps"]
    assert 0 < summary["bytes_sent_per_worker"] < summary["dense_bytes_per_worker"]
    assert summary["config"]["compressor"] == "topk:ratio=0.1"
    assert summary["config"]["workers"] == 2
    assert set(summary["versions"]) >= {"python", "torch", "gradzip"}
    assert err == ""  # no progress bar when stderr is not a terminal


def test_a_refused_train_leaves_the_finished_run_in_out_untouched(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    args = ["train", "--task", "digits", "--epochs", "1", "--workers", "2", "--limit-train",
            "200", "--milestones", "5", "--out", str(out)]
    code, _, err = run_cli(capsys, *args)
    assert code == 0, err
    files = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    for extra, message in (
        (["--batch-size", "10000"], "batch_size 16 there, 10000 here"),
        (["--compressor", "topk:ratio=0.1", "--resume"], "compressor 'none' there"),
        (["--epochs", "2"], "epochs 1 there, 2 here"),
        (["--checkpoint-every", "-1"], "`checkpoint_every` must be >= 0"),
    ):
        code, _, err = run_cli(capsys, *args, *extra)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == files
    code, stdout, err = run_cli(capsys, *args[:4], "2", *args[5:], "--resume")
    assert code == 0, err
    epochs = [r["epoch"] for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "epoch"]
    assert epochs == [1, 2] and ", 2 epochs," in stdout


def test_train_cifar10_on_a_tiny_fake_release(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_cifar: Path
) -> None:
    data = fake_cifar
    out = tmp_path / "c10"
    code, _, err = run_cli(capsys, "train", "--task", "cifar10", "--data", str(data),
                           "--cache-dir", str(tmp_path / "cache"), "--model", "resnet8:width=4",
                           "--batch-size", "8", "--compressor", "powersgd:rank=2",
                           "--out", str(out), *QUICK)
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and 0 <= summary["final_accuracy"] <= 1
    assert summary["config"]["model"] == "resnet8:width=4"


def test_train_lm_on_a_tiny_text(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    words = "the cat sat on a mat while dogs ran to the park".split()
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(" ".join(rng.choice(words, 10)) for _ in range(50)) + "\n")
    out = tmp_path / "lm"
    code, stdout, err = run_cli(capsys, "train", "--task", "lm", "--data", str(text),
                                "--model", "lstm:embed=16,hidden=16,layers=1",
                                "--batch-size", "4", "--bptt", "10",
                                "--compressor", "topk:ratio=0.1", "--out", str(out), *QUICK)
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["metric"] == "perplexity"
    assert 1 < summary["final_perplexity"] < 1000 and "final perplexity" in stdout
    assert summary["config"]["clip"] == 0.25  # the task's clipping of the averaged gradient


def test_train_logreg_generated(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "lr"
    code, _, err = run_cli(capsys, "train", "--task", "logreg",
                           "--compressor", "threshold:budget=0.05", "--out", str(out), *QUICK)
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_accuracy"] > 0.6  # a nearly separable problem, one epoch
    assert summary["config"]["dense_1d"] is False
    code, _, err = run_cli(capsys, "train", "--task", "logreg", "--dense-1d",
                           "--compressor", "threshold:budget=0.05", "--out", str(tmp_path / "d"),
                           *QUICK)
    assert code == 0, err
    dense = json.loads((tmp_path / "d" / "summary.json").read_text())
    assert dense["config"]["dense_1d"] is True
    # The bias travels uncompressed: more bytes than with everything thresholded.
    assert dense["bytes_sent_per_worker"] > summary["bytes_sent_per_worker"]


def test_train_logreg_libsvm(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    lines = []
    for _ in range(80):
        x = rng.normal(size=5)
        label = 1 if x[0] + x[1] > 0 else -1
        lines.append(f"{label} " + " ".join(f"{j + 1}:{v:.3f}" for j, v in enumerate(x)))
    data = tmp_path / "tiny.svm"
    data.write_text("\n".join(lines) + "\n")
    code, _, err = run_cli(capsys, "train", "--task", "logreg", "--data", str(data),
                           "--batch-size", "8", "--out", str(tmp_path / "svm"), *QUICK)
    assert code == 0, err


def test_train_with_accordion_logs_levels(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "acc"
    code, stdout, err = run_cli(capsys, "train", "--compressor", "powersgd:rank=1",
                                "--accordion", "powersgd:rank=4", "--interval-epochs", "1",
                                "--limit-train", "400", "--out", str(out), "--workers", "2",
                                "--epochs", "3", "--quiet")
    assert code == 0, err
    assert "Accordion" in stdout
    epochs = read_jsonl(out / "metrics.jsonl")
    # The first interval is critical by construction (nothing to compare with yet); biases,
    # sent dense at both PowerSGD levels, have no level to choose.
    assert epochs[0]["critical_fraction"] == 1.0
    assert set(epochs[0]["levels"].values()) <= {"critical", "steady", "dense"}
    assert all(0 <= r["critical_fraction"] <= 1 for r in epochs)
    decisions = json.loads((out / "accordion_decisions.json").read_text())
    assert decisions[0]["reason"] == "first"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accordion_counts"]["decisions"] >= 3


def test_train_with_accordion_batch_counts_rounds(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "accb"
    # micro-batch 16 x 2 workers = 32; critical rounds use 32 examples, steady ones 64.
    code, stdout, err = run_cli(capsys, "train", "--accordion-batch", "32,64",
                                "--interval-epochs", "1", "--limit-train", "400",
                                "--out", str(out), "--workers", "2", "--epochs", "3",
                                "--quiet", "--compressor", "topk:ratio=0.1")
    assert code == 0, err
    assert "global batch 32 <-> 64" in stdout
    epochs = read_jsonl(out / "metrics.jsonl")
    # 200 examples per worker = 12 micro-batches: 12 rounds per epoch at the small batch.
    assert epochs[0]["rounds"] == 12 and epochs[0]["global_batch"] in (32, 64)
    summary = json.loads((out / "summary.json").read_text())
    counts = summary["batch_counts"]
    assert counts["critical_rounds"] + counts["steady_rounds"] == summary["rounds"]
    assert counts["samples"] == 32 * counts["critical_rounds"] + 64 * counts["steady_rounds"]
    assert (out / "batch_decisions.json").exists()


# -- compare and demo -------------------------------------------------------------------
def test_compare_writes_csv_and_skips_finished_runs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    grid = tmp_path / "grid.toml"
    grid.write_text(
        'name = "tiny"\n[base]\ntask = "digits"\nworkers = 2\nepochs = 1\nlimit_train = 200\n'
        '[[runs]]\ncompressor = "none"\n[[runs]]\nlabel = "top"\ncompressor = "topk:ratio=0.1"\n'
    )
    out = tmp_path / "cmp"
    code, stdout, err = run_cli(capsys, "compare", str(grid), "--out", str(out))
    assert code == 0, err
    assert err.count("done in") == 2
    rows = (out / "results.csv").read_text().splitlines()
    assert rows[0].startswith("label,") and len(rows) == 3
    assert "top" in stdout and (out / "compare.png").stat().st_size > 0
    summary = out / "top" / "summary.json"
    before = summary.read_text()
    code, _, err = run_cli(capsys, "compare", str(grid), "--out", str(out))
    assert code == 0 and err.count("skipped") == 2 and summary.read_text() == before
    code, _, err = run_cli(capsys, "compare", str(grid), "--out", str(out), "--set", "seed=1")
    assert code == 2 and "another configuration (seed 0 there, 1 here)" in err
    assert len(err.strip().splitlines()) == 1 and summary.read_text() == before
    code, _, err = run_cli(capsys, "compare", str(grid), "--out", str(tmp_path / "cmp1"),
                           "--set", "seed=1")
    assert code == 0 and err.count("done in") == 2


def test_compare_unknown_preset_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "compare", "no-such-preset")
    assert code == 2 and "preset" in err and len(err.strip().splitlines()) == 1


def test_demo_end_to_end_shrunk(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "demo"
    code, stdout, err = run_cli(capsys, "demo", "--out", str(out), "--epochs", "1",
                                "--limit-train", "300", "--seeds", "1", "--quiet")
    assert code == 0, err
    for label in ("none", "topk 1%", "threshold 1%", "powersgd r1", "accordion"):
        assert label in stdout
    assert "plot: " in stdout and (out / "compare.png").stat().st_size > 0
    assert (out / "demo.png").stat().st_size > 0
    assert len((out / "results.csv").read_text().splitlines()) == 7


def test_demo_quick_is_one_epoch_on_a_few_images(capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path) -> None:
    from gradzip.cli import QUICK_DEMO

    out = tmp_path / "demo"
    code, stdout, err = run_cli(capsys, "demo", "--quick", "--out", str(out), "--quiet")
    assert code == 0, err
    assert "summary:" in stdout
    for run in sorted(p for p in out.iterdir() if p.is_dir()):
        config = json.loads((run / "run.json").read_text())["config"]
        assert config["epochs"] == QUICK_DEMO["epochs"] == 1
        assert config["limit_train"] == QUICK_DEMO["limit_train"] == 256
    assert len((out / "results.csv").read_text().splitlines()) == 7


def test_bench_argument_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from gradzip.bench.command import main as bench_main
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["micro", "--no-such-option"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "usage:" not in err
    assert err.startswith("gradzip bench: error: unrecognized arguments: --no-such-option")
