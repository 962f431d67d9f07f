"""Tests for CIFAR-10 loading (gradzip.train.cifar): the pickle release as a directory, its
parent or a tar archive, image folders (PNG, JPEG, tar), the decoded-array cache, and errors."""

from __future__ import annotations

import importlib.util
import pickle
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from gradzip.train import cifar as C
from gradzip.train import data as D

needs_pil = pytest.mark.skipif(importlib.util.find_spec("PIL") is None,
                               reason="needs Pillow (the `data` extra)")

def _rand_images(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 256, size=(n, 32, 32, 3), dtype=np.uint8)


def _write_pickle_release(root: Path, rng: np.random.Generator) -> dict[str, np.ndarray]:
    root.mkdir(parents=True)
    xs, ys = [], []
    for i in range(1, 6):
        x, y = _rand_images(rng, 20), rng.integers(0, 10, 20).tolist()
        flat = x.transpose(0, 3, 1, 2).reshape(20, 3072)
        with open(root / f"data_batch_{i}", "wb") as fh:
            pickle.dump({b"data": flat, b"labels": y}, fh)
        xs.append(x)
        ys += y
    xt, yt = _rand_images(rng, 10), rng.integers(0, 10, 10).tolist()
    with open(root / "test_batch", "wb") as fh:
        pickle.dump({b"data": xt.transpose(0, 3, 1, 2).reshape(10, 3072), b"labels": yt}, fh)
    names = [n.encode() for n in C.CIFAR10_CLASSES]
    with open(root / "batches.meta", "wb") as fh:
        pickle.dump({b"label_names": names}, fh)
    return {"x_train": np.concatenate(xs), "y_train": np.asarray(ys),
            "x_test": xt, "y_test": np.asarray(yt)}


def _raw(task: D.TaskData, split: str) -> np.ndarray:
    """Undo the normalisation, back to uint8 NHWC."""
    part = getattr(task, split)
    mean = torch.tensor(task.meta["mean"])[:, None, None]
    std = torch.tensor(task.meta["std"])[:, None, None]
    x = (part.x * std + mean) * 255.0
    return x.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


def test_cifar_pickle_release_dir_parent_and_tar(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    release = tmp_path / "dl" / "cifar-10-batches-py"
    ref = _write_pickle_release(release, rng)
    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(release, arcname="cifar-10-batches-py")
    for source in (release, release.parent, archive):
        task = C.load_cifar10(source, use_cache=False)
        assert task.meta["layout"] == "pickle"
        assert task.meta["classes"] == list(C.CIFAR10_CLASSES)
        assert task.num_classes == 10
        assert task.train.x.shape == (100, 3, 32, 32)
        assert task.test.x.shape == (10, 3, 32, 32)
        assert task.train.x.dtype == torch.float32
        np.testing.assert_array_equal(_raw(task, "train"), ref["x_train"])
        np.testing.assert_array_equal(_raw(task, "test"), ref["x_test"])
        np.testing.assert_array_equal(task.train.y.numpy(), ref["y_train"])
        np.testing.assert_array_equal(task.test.y.numpy(), ref["y_test"])
        means = task.train.x.mean(dim=(0, 2, 3))
        assert torch.allclose(means, torch.zeros(3), atol=1e-4)


def _write_folder_tree(root: Path, rng: np.random.Generator, ext: str) -> dict[str, list]:
    from PIL import Image

    truth: dict[str, list] = {"train": [], "test": []}
    for split, count in (("train", 3), ("test", 2)):
        for cls in ("cat", "airplane", "dog"):
            folder = root / split / cls
            folder.mkdir(parents=True)
            for i in range(count):
                img = _rand_images(rng, 1)[0]
                Image.fromarray(img).save(folder / f"{i}.{ext}")
                truth[split].append((cls, img))
    return truth


@needs_pil
def test_cifar_image_folder_png_exact(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    truth = _write_folder_tree(tmp_path / "cifar10", rng, "png")
    (tmp_path / "cifar10" / "train" / "cat" / ".DS_Store").write_bytes(b"junk")
    for source in (tmp_path / "cifar10", tmp_path):  # tree itself, or under a top folder
        task = C.load_cifar10(source, use_cache=False)
        assert task.meta["layout"] == "folder"
        assert task.meta["classes"] == ["airplane", "cat", "dog"]
        assert task.num_classes == 3
        assert task.train.x.shape == (9, 3, 32, 32) and task.test.x.shape == (6, 3, 32, 32)
        raw = _raw(task, "train")
        order = sorted(range(9), key=lambda i: truth["train"][i][0])  # stable by class
        for row, i in enumerate(order):
            cls, img = truth["train"][i]
            assert task.meta["classes"][int(task.train.y[row])] == cls
            np.testing.assert_array_equal(raw[row], img)


@needs_pil
def test_cifar_image_folder_jpeg_tar(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    tree = tmp_path / "src" / "cifar10"
    _write_folder_tree(tree, rng, "jpg")
    archive = tmp_path / "cifar10.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tree, arcname="cifar10")
    task = C.load_cifar10(archive, use_cache=False)
    assert task.train.x.shape == (9, 3, 32, 32)
    assert sorted(task.test.y.tolist()) == [0, 0, 1, 1, 2, 2]


@needs_pil
def test_cifar_cache_roundtrip(tmp_path: Path) -> None:
    tree = tmp_path / "data"
    _write_folder_tree(tree, np.random.default_rng(3), "png")
    cache = tmp_path / "cache"
    first = C.load_cifar10(tree, cache_dir=cache)
    cache_file = Path(first.meta["cache_file"])
    assert cache_file.is_file() and cache_file.parent == cache
    assert list(cache.glob("*.npz")) == [cache_file]
    second = C.load_cifar10(tree, cache_dir=cache)
    assert second.meta["cache_file"] == str(cache_file)
    assert torch.equal(first.train.x, second.train.x)
    assert torch.equal(first.test.y, second.test.y)
    assert first.meta["classes"] == second.meta["classes"]
    # Changing the source gives a new cache key.
    (tree / "test" / "cat" / "9.png").write_bytes((tree / "test" / "cat" / "0.png").read_bytes())
    third = C.load_cifar10(tree, cache_dir=cache)
    assert third.meta["cache_file"] != str(cache_file)
    assert len(third.test) == len(first.test) + 1


@needs_pil
def test_cifar_cache_hit_does_not_decode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tree = tmp_path / "data"
    _write_folder_tree(tree, np.random.default_rng(4), "png")
    first = C.load_cifar10(tree, cache_dir=tmp_path / "c")

    def boom(path: Path) -> dict:
        raise AssertionError("source was read despite a cache hit")

    monkeypatch.setattr(C, "_read_cifar", boom)
    second = C.load_cifar10(tree, cache_dir=tmp_path / "c")
    assert torch.equal(first.train.x, second.train.x)


@needs_pil
def test_cifar_corrupt_cache_is_rebuilt(tmp_path: Path) -> None:
    tree = tmp_path / "data"
    _write_folder_tree(tree, np.random.default_rng(5), "png")
    first = C.load_cifar10(tree, cache_dir=tmp_path / "c")
    Path(first.meta["cache_file"]).write_bytes(b"garbage")
    second = C.load_cifar10(tree, cache_dir=tmp_path / "c")
    assert torch.equal(first.train.x, second.train.x)
    with np.load(first.meta["cache_file"]) as cached:
        assert cached["x_train"].shape == (9, 32, 32, 3)


def test_decoding_without_pillow_is_a_clear_import_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for split in ("train", "test"):
        (tmp_path / split / "cat").mkdir(parents=True)
        (tmp_path / split / "cat" / "0.png").write_bytes(b"x")
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(ImportError, match="decoding JPEG files needs Pillow: pip install pillow"):
        C.load_cifar10(tmp_path, use_cache=False)


def test_cifar_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="`path` must be an existing path"):
        C.load_cifar10(tmp_path / "missing")
    with pytest.raises(TypeError, match="`path` must be a str or os.PathLike"):
        C.load_cifar10(3)  # type: ignore[arg-type]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="train/<class>/<image>"):
        C.load_cifar10(tmp_path / "empty", use_cache=False)
    plain = tmp_path / "x.bin"
    plain.write_bytes(b"abc")
    with pytest.raises(ValueError, match="tar archive"):
        C.load_cifar10(plain, use_cache=False)
