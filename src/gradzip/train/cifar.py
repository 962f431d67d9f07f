"""CIFAR-10 loading: the pickle release or ImageFolder trees, with a decoded-array cache.

The official ``cifar-10-batches-py`` release (a directory, a directory holding it, or the
``cifar-10-python.tar.gz`` archive) is read directly; any tree or tar archive with
``train/<class>/<image>`` and ``test/<class>/<image>`` files of 32x32 RGB images is decoded
with Pillow. Decoded uint8 arrays are cached as ``.npz`` keyed by the source's path, file
count, total size and newest modification time.
"""

from __future__ import annotations

import hashlib
import io
import logging
import lzma
import os
import pickle
import tarfile
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gradzip._validate import check_bool
from gradzip.train.data import PathLike, TaskData, TensorSplit, _check_path

__all__ = ["CIFAR10_CLASSES", "IMAGE_EXTENSIONS", "load_cifar10"]

logger = logging.getLogger(__name__)

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer",
                   "dog", "frog", "horse", "ship", "truck")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
_CACHE_KEYS = ("x_train", "y_train", "x_test", "y_test", "classes", "layout")


def _source_files(path: Path) -> dict[str, Callable[[], bytes]]:
    """Map relative POSIX paths of all files under ``path`` to byte readers.

    A tar archive is read in one sequential pass (gzip cannot seek cheaply);
    files of a directory are read on demand.
    """
    if path.is_dir():
        out: dict[str, Callable[[], bytes]] = {}
        for file in sorted(path.rglob("*")):
            if file.is_file():
                out[file.relative_to(path).as_posix()] = file.read_bytes
        return out
    blobs: dict[str, bytes] = {}
    try:
        # Inside the try: on an archive cut within its first header, even this test of the
        # header fails in the decompressor.
        if not tarfile.is_tarfile(path):
            raise ValueError(f"`path` must be a directory or a tar archive, got {str(path)!r}")
        with tarfile.open(path, "r:*") as tar:
            for member in tar:
                if member.isfile():
                    handle = tar.extractfile(member)
                    if handle is not None:
                        name = member.name
                        while name.startswith("./"):
                            name = name[2:]
                        blobs[name.lstrip("/")] = handle.read()
    # A truncated or corrupt archive fails in the decompressor (EOFError, zlib.error,
    # lzma.LZMAError, OSError) or in tarfile's own parsing, depending on where it breaks.
    except (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError) as exc:
        raise ValueError(f"`path` must be a readable tar archive, got a damaged one "
                         f"{str(path)!r}: {' '.join(str(exc).split()) or type(exc).__name__}"
                         ) from None
    return {name: (lambda b=blob: b) for name, blob in blobs.items()}


def _read_pickle_release(files: dict[str, Callable[[], bytes]],
                         prefix: str) -> dict[str, np.ndarray]:
    def unpickle(name: str, keys: tuple[bytes, ...] = (b"data", b"labels")) -> dict[bytes, Any]:
        try:
            batch = pickle.loads(files[prefix + name](), encoding="bytes")
        # Unpickling damaged bytes raises almost any exception type (UnpicklingError,
        # EOFError, ValueError, KeyError, ImportError, ...): each means "not a batch".
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"`path` file {prefix + name!r} must be a CIFAR-10 batch (a "
                             f"pickle), got unreadable bytes ({type(exc).__name__})") from None
        missing = [k.decode() for k in keys if not isinstance(batch, dict) or k not in batch]
        if missing:
            raise ValueError(f"`path` file {prefix + name!r} must be a CIFAR-10 batch with "
                             f"{' and '.join(k.decode() for k in keys)}, got a "
                             f"{type(batch).__name__} without {' and '.join(missing)}")
        return batch

    batches = sorted((n for n in files if n.startswith(prefix + "data_batch_")),
                     key=lambda n: int(n.rsplit("_", 1)[1]))
    if not batches:
        raise ValueError(f"`path` must hold data_batch_* files next to test_batch, got {prefix!r}")
    names = [n[len(prefix):] for n in batches] + ["test_batch"]
    loaded = {name: unpickle(name) for name in names}
    for name, batch in loaded.items():
        _check_batch(prefix + name, batch)
    parts, test = [loaded[n] for n in names[:-1]], loaded["test_batch"]

    def to_nhwc(batch: dict[bytes, Any]) -> np.ndarray:
        flat = np.asarray(batch[b"data"], dtype=np.uint8)
        return flat.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)

    classes = list(CIFAR10_CLASSES)
    if prefix + "batches.meta" in files:
        names = unpickle("batches.meta", (b"label_names",)).get(b"label_names")
        if names:
            classes = [n.decode() if isinstance(n, bytes) else str(n) for n in names]
    return {"x_train": np.concatenate([to_nhwc(p) for p in parts]),
            "y_train": np.concatenate([np.asarray(p[b"labels"]) for p in parts]).astype(np.int64),
            "x_test": to_nhwc(test),
            "y_test": np.asarray(test[b"labels"], dtype=np.int64),
            "classes": np.asarray(classes), "layout": np.asarray("pickle")}


def _check_batch(name: str, batch: dict[bytes, Any]) -> None:
    """Refuse a batch whose images are not rows of 3072 bytes or whose labels do not match."""
    try:
        data = np.asarray(batch[b"data"])
        labels = np.asarray(batch[b"labels"])
    except Exception as exc:  # noqa: BLE001 - anything unpickled may fail to convert
        raise ValueError(f"`path` file {name!r} must hold an image array and labels, got "
                         f"{type(exc).__name__}") from None
    if data.ndim != 2 or data.shape[1] != 3072 or data.dtype.kind not in "ui":
        raise ValueError(f"`path` file {name!r} must hold images as rows of 3072 bytes, got "
                         f"an array of shape {data.shape} and dtype {data.dtype}")
    if labels.shape != (data.shape[0],) or labels.dtype.kind not in "ui":
        raise ValueError(f"`path` file {name!r} must hold one integer label per image, got "
                         f"{labels.shape[0] if labels.ndim else 0} labels for {data.shape[0]} "
                         f"images")


def _decode_image(data: bytes, name: str) -> np.ndarray:
    try:
        from PIL import Image
    except ImportError as exc:
        raise ImportError("decoding JPEG files needs Pillow: pip install pillow") from exc
    try:
        with Image.open(io.BytesIO(data)) as img:
            arr = np.asarray(img.convert("RGB"), dtype=np.uint8)
    except (OSError, ValueError, SyntaxError) as exc:  # Pillow's "cannot identify", truncation
        raise ValueError(f"`path` image {name!r} must be a readable image, got "
                         f"{' '.join(str(exc).split()) or type(exc).__name__}") from None
    if arr.shape != (32, 32, 3):
        raise ValueError(f"`path` must contain 32x32 images, got {arr.shape[:2]} in {name!r}")
    return arr


def _read_image_folder(files: dict[str, Callable[[], bytes]]) -> dict[str, np.ndarray]:
    entries: dict[str, list[tuple[str, str]]] = {"train": [], "test": []}
    prefixes = set()
    for name in files:
        parts = name.split("/")
        if any(p.startswith(".") for p in parts) or not name.lower().endswith(IMAGE_EXTENSIONS):
            continue
        if len(parts) >= 3 and parts[-3] in entries:
            prefixes.add("/".join(parts[:-3]))
            entries[parts[-3]].append((parts[-2], name))
    if not entries["train"] or not entries["test"]:
        raise ValueError("`path` must be a CIFAR-10 pickle release or hold train/<class>/<image> "
                         "and test/<class>/<image> files, got neither")
    if len(prefixes) > 1:
        raise ValueError(f"`path` must hold a single train/test tree, got {sorted(prefixes)}")
    classes = sorted({cls for cls, _ in entries["train"]})
    unknown = sorted({cls for cls, _ in entries["test"]} - set(classes))
    if unknown:
        raise ValueError(f"`path` test classes must appear in train, got extra {unknown}")
    index = {cls: i for i, cls in enumerate(classes)}
    out: dict[str, np.ndarray] = {"classes": np.asarray(classes), "layout": np.asarray("folder")}
    for split, items in entries.items():
        items.sort()
        logger.info("decoding %d %s images", len(items), split)
        out[f"x_{split}"] = np.stack([_decode_image(files[n](), n) for _, n in items])
        out[f"y_{split}"] = np.asarray([index[c] for c, _ in items], dtype=np.int64)
    return out


def _read_cifar(path: Path) -> dict[str, np.ndarray]:
    files = _source_files(path)
    tests = sorted((n for n in files if n.rsplit("/", 1)[-1] == "test_batch"), key=len)
    if tests:
        return _read_pickle_release(files, tests[0][: -len("test_batch")])
    return _read_image_folder(files)


def _cache_key(path: Path) -> str:
    if path.is_file():
        stats = [path.stat()]
    else:
        stats = [os.stat(os.path.join(top, name))
                 for top, _, names in os.walk(path) for name in names]
    size = sum(s.st_size for s in stats)
    mtime = max((s.st_mtime_ns for s in stats), default=0)
    text = f"{path.resolve()}|{len(stats)}|{size}|{mtime}"
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def load_cifar10(path: PathLike, cache_dir: PathLike | None = None,
                 use_cache: bool = True) -> TaskData:
    """Load CIFAR-10 (or any 32x32 RGB ImageFolder tree) into memory.

    Accepted ``path`` layouts: the official ``cifar-10-batches-py`` directory,
    a directory containing it, ``cifar-10-python.tar.gz``; or a directory or
    tar archive holding ``train/<class>/<img>`` and ``test/<class>/<img>``,
    possibly under a top folder. Decoded arrays are cached as ``.npz``.
    The official release is a set of Python pickles: only load files you
    trust, as unpickling can run arbitrary code.

    Args:
        path: Directory or tar archive with the data.
        cache_dir: Cache directory; defaults to ``~/.cache/gradzip``.
        use_cache: Read and write the decoded-array cache.

    Returns:
        TaskData with x float32 [n, 3, 32, 32] normalised per channel with
        the train mean/std, y int64 [n]; ``meta`` holds classes, mean, std,
        layout and the cache file path (or None).

    Raises:
        TypeError: If ``path`` or ``cache_dir`` is not path-like.
        ValueError: If the path does not exist or has an unknown layout.
        ImportError: If image files must be decoded and Pillow is missing.
    """
    src = _check_path("path", path)
    use_cache = check_bool("use_cache", use_cache)
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise TypeError(f"`cache_dir` must be a str, os.PathLike or None, got {cache_dir!r}")
    cache_file = None
    arrays: dict[str, np.ndarray] | None = None
    if use_cache:
        default_root = Path.home() / ".cache" / "gradzip"
        root = Path(cache_dir).expanduser() if cache_dir is not None else default_root
        cache_file = root / f"cifar10-{_cache_key(src)}.npz"
        if cache_file.is_file():
            logger.info("loading cached arrays from %s", cache_file)
            try:
                with np.load(cache_file) as cached:
                    arrays = {k: cached[k] for k in cached.files}
                missing = set(_CACHE_KEYS) - set(arrays)
                if missing:
                    raise KeyError(f"missing {sorted(missing)}")
            except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
                logger.warning("ignoring unreadable cache %s: %s", cache_file, exc)
                arrays = None
    if arrays is None:
        arrays = _read_cifar(src)
        if cache_file is not None:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(f".tmp{os.getpid()}.npz")
            np.savez(tmp, **arrays)
            os.replace(tmp, cache_file)
            logger.info("cached decoded arrays in %s", cache_file)

    def to_float(images: np.ndarray) -> Tensor:
        return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous().float().div_(255.0)

    x_train, x_test = to_float(arrays["x_train"]), to_float(arrays["x_test"])
    mean = x_train.mean(dim=(0, 2, 3))
    std = x_train.std(dim=(0, 2, 3)).clamp_min(1e-6)

    def scale(t: Tensor) -> Tensor:
        return t.sub_(mean[:, None, None]).div_(std[:, None, None])

    classes = [str(c) for c in arrays["classes"].tolist()]
    meta = {"name": "cifar10", "classes": classes, "mean": mean.tolist(), "std": std.tolist(),
            "layout": str(arrays["layout"]), "cache_file": str(cache_file) if cache_file else None}
    return TaskData(TensorSplit(scale(x_train), torch.from_numpy(arrays["y_train"]).long()),
                    TensorSplit(scale(x_test), torch.from_numpy(arrays["y_test"]).long()),
                    len(classes), meta)
