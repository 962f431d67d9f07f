"""One-line errors from the ``gradzip`` command: argparse errors, ``--out`` paths the file
system cannot take, damaged data files, unusable grid files. Each is refused with exit
status 2 and one line before anything is written."""

from __future__ import annotations

import os
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest

from gradzip.cli import main
from gradzip.train.cifar import load_cifar10
from gradzip.train.text import load_text

QUICK = ["--workers", "2", "--epochs", "1", "--limit-train", "32", "--quiet"]


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the command, expect the one-line refusal (exit 2), return that line."""
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse exits itself
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and "usage:" not in err
    return lines[0]


# -- argparse -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["train", "--out", "x", "--epochs", "x"], "argument --epochs: invalid int value: 'x'"),
        (["train", "--out", "x", "--launcher", "zz"], "argument --launcher: invalid choice: 'zz'"),
        (["train"], "the following arguments are required: --out"),
        (["compare"], "the following arguments are required: CONFIG"),
        (["nope"], "argument COMMAND: invalid choice: 'nope'"),
    ],
)
def test_argparse_errors_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str],
                                      fragment: str) -> None:
    line = refused(capsys, *argv)
    assert fragment in line
    assert line.startswith("gradzip")
    assert line.endswith("--help)")


# -- --out ------------------------------------------------------------------------------------
def test_out_below_a_file_is_a_configuration_error(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "afile"
    blocker.write_text("mine\n")
    for out in (blocker / "run", blocker / "run" / "deeper"):
        line = refused(capsys, "train", "--out", str(out), *QUICK)
        assert f"lies below the file {str(blocker)!r}" in line
    assert blocker.read_text() == "mine\n"


def test_over_long_out_names_are_configuration_errors(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    name_max = os.pathconf(tmp_path, "PC_NAME_MAX")
    long_name = "x" * (name_max + 1)
    for out in (tmp_path / long_name, tmp_path / "a" / long_name / "b"):
        line = refused(capsys, "train", "--out", str(out), *QUICK)
        assert f"`out` folder names must be at most {name_max} bytes" in line
    deep = tmp_path.joinpath(*["y" * 200] * (os.pathconf(tmp_path, "PC_PATH_MAX") // 200 + 1))
    assert "`out` must be a path shorter than" in refused(capsys, "train", "--out", str(deep),
                                                         *QUICK)
    assert list(tmp_path.iterdir()) == []  # nothing was created


@pytest.mark.parametrize(
    ("entry", "make", "fragment"),
    [
        ("checkpoint", "file", "`out` entry 'checkpoint' must be a folder (the run's checkpoints)"),
        ("checkpoint/latest.json", "dir",
         "`out` entry 'checkpoint/latest.json' must be a regular file, got a folder"),
        ("summary.json", "dir", "`out` entry 'summary.json' must be a regular file, got a folder"),
    ],
)
@pytest.mark.parametrize("resume", [False, True])
def test_out_entries_of_the_wrong_kind_are_named(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], snapshot, entry: str, make: str,
        fragment: str, resume: bool) -> None:
    out = tmp_path / "run"
    out.mkdir()
    target = out / entry
    target.parent.mkdir(parents=True, exist_ok=True)
    if make == "file":
        target.write_text("not a folder\n")
    else:
        target.mkdir()
    (target / "keep" if make == "dir" else out / "keep").write_text("x\n")
    before = snapshot(out)
    line = refused(capsys, "train", "--out", str(out), *QUICK, *(["--resume"] if resume else []))
    assert fragment in line
    assert "another configuration" not in line
    assert snapshot(out) == before


# -- data ---------------------------------------------------------------------------------------
def _cifar_variants(release: Path, tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Damaged copies of a tiny CIFAR-10 release: path and the fragment their refusal holds."""
    archive = tmp_path / "cifar.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(release, arcname="cifar-10-batches-py")
    data = archive.read_bytes()
    truncated = tmp_path / "truncated.tar.gz"
    truncated.write_bytes(data[: len(data) // 2])
    variants = {"truncated": (truncated, "must be a readable tar archive, got a damaged one")}
    # Cut within the first header: even the test of whether it is an archive fails there.
    header = tmp_path / "trunc_header.tar.gz"
    header.write_bytes(data[:30])
    variants["trunc_header"] = (header, "must be a readable tar archive, got a damaged one")

    def copy(name: str, batch: str, content: bytes) -> Path:
        root = tmp_path / name / "cifar-10-batches-py"
        root.mkdir(parents=True)
        for file in release.iterdir():
            (root / file.name).write_bytes(file.read_bytes())
        (root / batch).write_bytes(content)
        return root

    variants["garbage"] = (copy("garbage", "data_batch_2", b"garbage, not a pickle"),
                           "data_batch_2' must be a CIFAR-10 batch (a pickle), got unreadable")
    variants["no-keys"] = (copy("nokeys", "test_batch", pickle.dumps({"x": 1})),
                           "test_batch' must be a CIFAR-10 batch with data and labels")
    bad_rows = {b"data": np.zeros((3, 7), np.uint8), b"labels": [1, 2, 3]}
    variants["shape"] = (copy("shape", "data_batch_1", pickle.dumps(bad_rows)),
                         "data_batch_1' must hold images as rows of 3072 bytes, got an array "
                         "of shape (3, 7)")
    bad_labels = {b"data": np.zeros((3, 3072), np.uint8), b"labels": [1, 2]}
    variants["labels"] = (copy("labels", "data_batch_1", pickle.dumps(bad_labels)),
                          "must hold one integer label per image, got 2 labels for 3 images")
    return variants


def test_damaged_cifar_files_are_refused_naming_data(
        fake_cifar: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for path, fragment in _cifar_variants(fake_cifar, tmp_path).values():
        with pytest.raises(ValueError) as info:
            load_cifar10(path, use_cache=False)
        assert str(info.value).startswith("`path` ") and fragment in str(info.value)
        out = tmp_path / "out"
        line = refused(capsys, "train", "--task", "cifar10", "--model", "resnet8", "--data",
                       str(path), "--batch-size", "4", "--cache-dir", str(tmp_path / "cache"),
                       "--out", str(out), *QUICK)
        assert line.startswith("gradzip train: error: `--data` ") and fragment in line
        assert not out.exists()


def test_non_utf8_text_files_are_refused_naming_the_option_and_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "corpus.txt"
    text.write_bytes(b"hello world\n" * 20 + b"caf\xe9 latin-1\n" + b"more words\n" * 20)
    fragment = f"file {str(text)!r} must be UTF-8 text, got byte 0xe9 at offset 243"
    with pytest.raises(ValueError, match="^`path` " + fragment.replace("(", r"\(")):
        load_text(text)
    line = refused(capsys, "train", "--task", "lm", "--data", str(text),
                   "--out", str(tmp_path / "lm"), *QUICK)
    assert line == f"gradzip train: error: `--data` {fragment} (invalid continuation byte)"
    folder = tmp_path / "ptb"
    folder.mkdir()
    (folder / "ptb.train.txt").write_text("a b c\n" * 10)
    (folder / "ptb.valid.txt").write_bytes(b"\xff\n")
    line = refused(capsys, "train", "--task", "lm", "--data", str(folder),
                   "--out", str(tmp_path / "lm"), *QUICK)
    assert f"`--data` file {str(folder / 'ptb.valid.txt')!r} must be UTF-8 text" in line
    svm = tmp_path / "data.svm"
    svm.write_bytes(b"1 1:0.5\n\xff 2:1\n")
    line = refused(capsys, "train", "--task", "logreg", "--data", str(svm),
                   "--out", str(tmp_path / "lr"), *QUICK)
    assert f"`--data` file {str(svm)!r} must be UTF-8 text, got byte 0xff at offset 8" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "data.svm", "ptb"]


# -- grid files ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "content", "fragment"),
    [
        ("empty.toml", b"", "`config` must define runs ([base], [grid] or [[runs]] tables)"),
        ("named.toml", b'name = "nothing"\n', "`config` must define runs"),
        ("none.toml", b'name = "x"\nruns = []\n', "`config` must define runs"),
        ("empty.json", b"{}", "`config` must define runs"),
        ("table.toml", b'runs = {a = 1}\n', "`config` key 'runs' must be a list of tables"),
        ("latin.toml", b'name = "caf\xe9"\n', "latin.toml' must be UTF-8 text, got byte 0xe9 at offset 11"),
    ],
)
def test_unusable_grid_files_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         name: str, content: bytes, fragment: str) -> None:
    grid = tmp_path / name
    grid.write_bytes(content)
    out = tmp_path / "out"
    line = refused(capsys, "compare", str(grid), "--out", str(out), "--quiet")
    assert fragment in line
    assert not out.exists()


def test_unreadable_image_in_a_folder_tree_is_named(tmp_path: Path) -> None:
    image = pytest.importorskip("PIL.Image", reason="needs the `data` extra (Pillow)")
    root = tmp_path / "tree"
    for split in ("train", "test"):
        (root / split / "cat").mkdir(parents=True)
        image.new("RGB", (32, 32)).save(root / split / "cat" / "ok.png")
    (root / "test" / "cat" / "bad.png").write_bytes(b"not an image at all")
    with pytest.raises(ValueError) as info:
        load_cifar10(root, use_cache=False)
    message = str(info.value)
    assert message.startswith("`path` image 'test/cat/bad.png' must be a readable image, got ")
    assert "\n" not in message
