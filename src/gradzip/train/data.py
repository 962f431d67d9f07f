"""In-memory data sets, sharding and augmentation for gradzip training.

Everything here keeps whole data sets as tensors in RAM. Only ``torch`` and
``numpy`` are needed; decoding JPEG/PNG image folders needs Pillow.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import io
import logging
import math
import os
import pickle
import tarfile
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer",
                   "dog", "frog", "horse", "ship", "truck")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
UNK, EOS = "<unk>", "<eos>"
_CACHE_KEYS = ("x_train", "y_train", "x_test", "y_test", "classes", "layout")


@dataclass
class TensorSplit:
    """One split of a data set: inputs ``x`` and integer labels ``y``."""

    x: Tensor
    y: Tensor

    def __len__(self) -> int:
        return int(self.y.shape[0])


@dataclass
class TaskData:
    """A classification task: train/test splits, class count and metadata."""

    train: TensorSplit
    test: TensorSplit
    num_classes: int
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class LMData:
    """A language-modelling corpus as token ids plus its vocabulary."""

    train_ids: Tensor
    valid_ids: Tensor
    vocab: list[str]


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{name}` must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}")
    return value


def _check_fraction(name: str, value: Any, allow_zero: bool = False) -> float:
    bound = "0 <= x < 1" if allow_zero else "0 < x < 1"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{name}` must be a number with {bound}, got {value!r}")
    if not (0.0 <= value < 1.0) or (value == 0 and not allow_zero):
        raise ValueError(f"`{name}` must be a number with {bound}, got {value!r}")
    return float(value)


def _check_path(name: str, value: Any) -> Path:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"`{name}` must be a str or os.PathLike, got {value!r}")
    path = Path(value).expanduser()
    if not path.exists():
        raise ValueError(f"`{name}` must be an existing path, got {str(value)!r}")
    return path


def _split_indices(n: int, test_fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=gen)
    n_test = min(n - 1, max(1, round(n * test_fraction)))
    return perm[n_test:].sort().values, perm[:n_test].sort().values


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> TaskData:
    """Load the embedded 8x8 handwritten digits (1797 images, 10 classes).

    Args:
        test_fraction: Fraction of images held out for testing, in (0, 1).
        seed: Seed of the deterministic train/test split.

    Returns:
        TaskData with x float32 [n, 1, 8, 8] (pixels scaled to [0, 1], then
        normalised with the train mean/std) and y int64 [n].

    Raises:
        ValueError: If an argument is out of range.
    """
    _check_fraction("test_fraction", test_fraction)
    _check_int("seed", seed, 0)
    resource = importlib.resources.files("gradzip.data").joinpath("digits.npz")
    with resource.open("rb") as fh, np.load(fh) as arrays:
        images, labels = arrays["images"], arrays["labels"]
    x = torch.from_numpy(images.astype(np.float32) / 16.0).unsqueeze(1)
    y = torch.from_numpy(labels.astype(np.int64))
    train_idx, test_idx = _split_indices(len(y), test_fraction, seed)
    mean = float(x[train_idx].mean())
    std = float(x[train_idx].std())
    x = (x - mean) / std
    meta = {"name": "digits", "mean": mean, "std": std, "seed": seed}
    return TaskData(TensorSplit(x[train_idx], y[train_idx]),
                    TensorSplit(x[test_idx], y[test_idx]), 10, meta)


# ---------------------------------------------------------------- CIFAR-10


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
    if not tarfile.is_tarfile(path):
        raise ValueError(f"`path` must be a directory or a tar archive, got {str(path)!r}")
    blobs: dict[str, bytes] = {}
    with tarfile.open(path, "r:*") as tar:
        for member in tar:
            if member.isfile():
                handle = tar.extractfile(member)
                if handle is not None:
                    name = member.name
                    while name.startswith("./"):
                        name = name[2:]
                    blobs[name.lstrip("/")] = handle.read()
    return {name: (lambda b=blob: b) for name, blob in blobs.items()}


def _read_pickle_release(files: dict[str, Callable[[], bytes]],
                         prefix: str) -> dict[str, np.ndarray]:
    def unpickle(name: str) -> dict[bytes, Any]:
        return pickle.loads(files[prefix + name](), encoding="bytes")

    batches = sorted((n for n in files if n.startswith(prefix + "data_batch_")),
                     key=lambda n: int(n.rsplit("_", 1)[1]))
    if not batches:
        raise ValueError(f"`path` must hold data_batch_* files next to test_batch, got {prefix!r}")
    parts = [unpickle(n[len(prefix):]) for n in batches]
    test = unpickle("test_batch")

    def to_nhwc(batch: dict[bytes, Any]) -> np.ndarray:
        flat = np.asarray(batch[b"data"], dtype=np.uint8)
        return flat.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)

    classes = list(CIFAR10_CLASSES)
    if prefix + "batches.meta" in files:
        names = unpickle("batches.meta").get(b"label_names")
        if names:
            classes = [n.decode() if isinstance(n, bytes) else str(n) for n in names]
    return {"x_train": np.concatenate([to_nhwc(p) for p in parts]),
            "y_train": np.concatenate([np.asarray(p[b"labels"]) for p in parts]).astype(np.int64),
            "x_test": to_nhwc(test),
            "y_test": np.asarray(test[b"labels"], dtype=np.int64),
            "classes": np.asarray(classes), "layout": np.asarray("pickle")}


def _decode_image(data: bytes, name: str) -> np.ndarray:
    try:
        from PIL import Image
    except ImportError as exc:
        raise ImportError("decoding JPEG files needs Pillow: pip install pillow") from exc
    with Image.open(io.BytesIO(data)) as img:
        arr = np.asarray(img.convert("RGB"), dtype=np.uint8)
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
    if not isinstance(use_cache, bool):
        raise TypeError(f"`use_cache` must be a bool, got {use_cache!r}")
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


def augment_batch(x: Tensor, generator: torch.Generator, pad: int = 4,
                  flip: bool = True) -> Tensor:
    """Random crop with zero padding plus random horizontal flip, vectorised.

    Args:
        x: Image batch [B, C, H, W].
        generator: Source of all randomness (the global RNG is never used).
        pad: Zero padding on each side before cropping back to H x W.
        flip: Flip each image horizontally with probability 1/2.

    Returns:
        Augmented batch with the same shape, dtype and device as ``x``.

    Raises:
        TypeError: If ``x`` or ``generator`` has the wrong type.
        ValueError: If ``x`` is not 4-D or ``pad`` is negative.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"`x` must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"`x` must be a 4-D tensor [B, C, H, W], got shape {tuple(x.shape)}")
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"`generator` must be a torch.Generator, got {generator!r}")
    _check_int("pad", pad, 0)
    b, _, h, w = x.shape
    gdev = generator.device
    oy = torch.randint(0, 2 * pad + 1, (b,), generator=generator, device=gdev).to(x.device)
    ox = torch.randint(0, 2 * pad + 1, (b,), generator=generator, device=gdev).to(x.device)
    cols = torch.arange(w, device=x.device).expand(b, w)
    if flip:
        flips = torch.rand(b, generator=generator, device=gdev).to(x.device) < 0.5
        cols = torch.where(flips[:, None], cols.flip(1), cols)
    rows = oy[:, None] + torch.arange(h, device=x.device)
    cols = ox[:, None] + cols
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad)) if pad else x
    batch_idx = torch.arange(b, device=x.device)[:, None, None]
    out = padded[batch_idx, :, rows[:, :, None], cols[:, None, :]]  # [B, H, W, C]
    return out.permute(0, 3, 1, 2).contiguous()


# ---------------------------------------------------------------- text


def _text_parts(path: Path, valid_fraction: float) -> tuple[str, str]:
    if path.is_dir():
        found = {}
        for key in ("train", "valid"):
            hits = sorted(p for p in path.iterdir() if p.is_file() and key in p.name)
            if len(hits) != 1:
                names = [p.name for p in hits]
                raise ValueError(f"`path` must hold exactly one *{key}* file, got {names}")
            found[key] = hits[0].read_text(encoding="utf-8")
        return found["train"], found["valid"]
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    if len(lines) >= 2:
        cut = min(len(lines) - 1, max(1, round(len(lines) * (1 - valid_fraction))))
        return "".join(lines[:cut]), "".join(lines[cut:])
    cut = max(1, round(len(text) * (1 - valid_fraction)))
    return text[:cut], text[cut:]


def _tokenize(text: str, level: str) -> list[str]:
    if level == "char":
        return list(text)
    tokens: list[str] = []
    for line in text.splitlines():
        tokens.extend(line.split())
        tokens.append(EOS)
    return tokens


def load_text(path: PathLike, level: str = "word", valid_fraction: float = 0.1) -> LMData:
    """Load a text corpus for language modelling.

    A file is split by lines: the last ``valid_fraction`` of lines become the
    validation part. A directory must hold one file with ``train`` and one
    with ``valid`` in its name (e.g. ``ptb.train.txt``, ``ptb.valid.txt``).
    Word level splits on whitespace and appends ``<eos>`` to every line; char
    level keeps every character, newlines included. The vocabulary comes
    from the train part (``<unk>`` first, then by decreasing frequency).

    Args:
        path: Text file or directory.
        level: ``"word"`` or ``"char"``.
        valid_fraction: Validation fraction for a single file, in (0, 1).

    Returns:
        LMData with int64 id tensors and the vocabulary list.

    Raises:
        TypeError: If ``path`` is not path-like.
        ValueError: If an argument is invalid or a part holds no tokens.
    """
    src = _check_path("path", path)
    if level not in ("word", "char"):
        raise ValueError(f"`level` must be one of 'word', 'char', got {level!r}")
    _check_fraction("valid_fraction", valid_fraction)
    train_text, valid_text = _text_parts(src, valid_fraction)
    train_tokens, valid_tokens = _tokenize(train_text, level), _tokenize(valid_text, level)
    if not train_tokens or not valid_tokens:
        raise ValueError(f"`path` must give non-empty train and valid parts, got {str(src)!r}")
    counts = Counter(train_tokens)
    counts.pop(UNK, None)
    vocab = [UNK] + sorted(counts, key=lambda t: (-counts[t], t))
    index = {tok: i for i, tok in enumerate(vocab)}

    def encode(tokens: list[str]) -> Tensor:
        return torch.tensor([index.get(t, 0) for t in tokens], dtype=torch.long)

    return LMData(encode(train_tokens), encode(valid_tokens), vocab)


def batchify(ids: Tensor, batch_size: int) -> Tensor:
    """Arrange a 1-D token stream into ``batch_size`` columns.

    Args:
        ids: 1-D tensor of token ids.
        batch_size: Number of parallel streams.

    Returns:
        Tensor [T, batch_size] with T = len(ids) // batch_size (tail dropped).

    Raises:
        TypeError: If ``ids`` is not a tensor.
        ValueError: If ``ids`` is not 1-D or too short for one row.
    """
    if not isinstance(ids, Tensor):
        raise TypeError(f"`ids` must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dim() != 1:
        raise ValueError(f"`ids` must be a 1-D tensor, got shape {tuple(ids.shape)}")
    _check_int("batch_size", batch_size, 1)
    steps = ids.numel() // batch_size
    if steps == 0:
        raise ValueError(f"`batch_size` must be <= len(ids)={ids.numel()}, got {batch_size}")
    return ids[: steps * batch_size].view(batch_size, steps).t().contiguous()


def bptt_batches(data: Tensor, bptt: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Iterate over truncated-BPTT windows of a batchified stream.

    Args:
        data: Tensor [T, B] from :func:`batchify`.
        bptt: Window length.

    Returns:
        Iterator of (input, target) pairs, each [L, B] with L <= bptt, where
        target is input shifted one step ahead.

    Raises:
        TypeError: If ``data`` is not a tensor.
        ValueError: If ``data`` is not 2-D or ``bptt`` < 1.
    """
    if not isinstance(data, Tensor):
        raise TypeError(f"`data` must be a torch.Tensor, got {type(data).__name__}")
    if data.dim() != 2:
        raise ValueError(f"`data` must be a 2-D tensor [T, B], got shape {tuple(data.shape)}")
    _check_int("bptt", bptt, 1)

    def gen() -> Iterator[tuple[Tensor, Tensor]]:
        for start in range(0, data.shape[0] - 1, bptt):
            length = min(bptt, data.shape[0] - 1 - start)
            yield data[start:start + length], data[start + 1:start + 1 + length]

    return gen()


# ---------------------------------------------------------------- tabular


def _parse_libsvm(path: Path) -> tuple[list[float], list[dict[int, float]]]:
    labels: list[float] = []
    rows: list[dict[int, float]] = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            tokens = line.split("#", 1)[0].split()
            if not tokens:
                continue
            try:
                labels.append(float(tokens[0]))
                row = {}
                for tok in tokens[1:]:
                    key, val = tok.split(":", 1)
                    if key == "qid":
                        continue
                    if int(key) < 1:
                        raise ValueError(f"feature index {key} < 1")
                    row[int(key)] = float(val)
            except ValueError as exc:
                where = f"{path.name}:{lineno}"
                raise ValueError(f"`path` must be in LIBSVM format, got {where}: {exc}") from exc
            rows.append(row)
    if not rows:
        raise ValueError(f"`path` must hold at least one LIBSVM row, got {str(path)!r}")
    return labels, rows


def load_libsvm(path: PathLike, num_features: int | None = None, test_path: PathLike | None = None,
                test_fraction: float = 0.2, seed: int = 0) -> TaskData:
    """Load a LIBSVM-format classification file as dense float32 tensors.

    Args:
        path: Training file (``label idx:val ...``, 1-based indices).
        num_features: Feature count; defaults to the largest index seen.
        test_path: Optional test file; otherwise a seeded split of ``path``.
        test_fraction: Held-out fraction when ``test_path`` is None.
        seed: Seed of that split.

    Returns:
        TaskData with x float32 [n, d] and y int64 [n]; the sorted distinct
        labels (e.g. -1/+1, 0/1, 1/2) map to 0..C-1 (``meta["labels"]``).

    Raises:
        TypeError: If a path is not path-like.
        ValueError: On malformed files or out-of-range arguments.
    """
    src = _check_path("path", path)
    _check_int("seed", seed, 0)
    _check_fraction("test_fraction", test_fraction)
    parts = [_parse_libsvm(src)]
    if test_path is not None:
        parts.append(_parse_libsvm(_check_path("test_path", test_path)))
    max_index = max(max(r, default=0) for _, rows in parts for r in rows)
    if num_features is None:
        num_features = max(max_index, 1)
    elif _check_int("num_features", num_features, 1) < max_index:
        raise ValueError(
            f"`num_features` must be >= the largest index {max_index}, got {num_features}")
    values = sorted({lab for labels, _ in parts for lab in labels})
    label_map = {v: i for i, v in enumerate(values)}
    splits = []
    for labels, rows in parts:
        x = np.zeros((len(rows), num_features), dtype=np.float32)
        for i, row in enumerate(rows):
            for j, val in row.items():
                x[i, j - 1] = val
        y = np.asarray([label_map[v] for v in labels], dtype=np.int64)
        splits.append(TensorSplit(torch.from_numpy(x), torch.from_numpy(y)))
    if test_path is None:
        whole = splits[0]
        train_idx, test_idx = _split_indices(len(whole), test_fraction, seed)
        splits = [TensorSplit(whole.x[train_idx], whole.y[train_idx]),
                  TensorSplit(whole.x[test_idx], whole.y[test_idx])]
    meta = {"name": src.name, "labels": values, "num_features": num_features}
    return TaskData(splits[0], splits[1], max(len(values), 2), meta)


def make_logreg_problem(n: int = 2000, d: int = 100, seed: int = 0, test_fraction: float = 0.2,
                        flip_prob: float = 0.05) -> TaskData:
    """Generate a nearly linearly separable synthetic binary problem.

    Features are standard normal; labels are the sign of a random linear
    function, each flipped with probability ``flip_prob``.

    Args:
        n: Number of examples (>= 2).
        d: Number of features.
        seed: Generator seed.
        test_fraction: Held-out fraction.
        flip_prob: Label noise in [0, 1).

    Returns:
        TaskData with x float32 [n, d], y int64 in {0, 1}; ``meta["w"]`` is
        the true weight vector.

    Raises:
        ValueError: If an argument is out of range.
    """
    _check_int("n", n, 2)
    _check_int("d", d, 1)
    _check_int("seed", seed, 0)
    _check_fraction("test_fraction", test_fraction)
    _check_fraction("flip_prob", flip_prob, allow_zero=True)
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(d, generator=gen) / math.sqrt(d)
    x = torch.randn(n, d, generator=gen)
    flips = torch.rand(n, generator=gen) < flip_prob
    y = ((x @ w > 0) ^ flips).long()
    train_idx, test_idx = _split_indices(n, test_fraction, seed)
    meta = {"name": "synthetic-logreg", "w": w, "flip_prob": flip_prob}
    return TaskData(TensorSplit(x[train_idx], y[train_idx]),
                    TensorSplit(x[test_idx], y[test_idx]), 2, meta)


# ---------------------------------------------------------------- sharding


def shard_indices(n: int, world_size: int, rank: int, epoch: int, seed: int) -> Tensor:
    """Indices of one worker's shard for one epoch.

    A permutation seeded from (seed, epoch) is cut into ``world_size`` equal,
    disjoint, contiguous pieces; the ``n % world_size`` leftover indices are
    dropped so that every worker sees the same number of examples.

    Args:
        n: Data set size.
        world_size: Number of workers.
        rank: This worker's rank in [0, world_size).
        epoch: Epoch number (>= 0).
        seed: Base seed (>= 0), equal on all workers.

    Returns:
        int64 tensor of ``n // world_size`` indices.

    Raises:
        ValueError: If an argument is out of range.
    """
    _check_int("world_size", world_size, 1)
    _check_int("n", n, world_size)
    _check_int("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(f"`rank` must be < world_size={world_size}, got {rank}")
    _check_int("epoch", epoch, 0)
    _check_int("seed", seed, 0)
    state = np.random.SeedSequence([seed, epoch]).generate_state(1, dtype=np.uint64)[0]
    gen = torch.Generator().manual_seed(int(state) & ((1 << 63) - 1))
    per = n // world_size
    return torch.randperm(n, generator=gen)[rank * per:(rank + 1) * per].clone()


def iter_batches(split: TensorSplit, indices: Tensor, batch_size: int,
                 drop_last: bool = True) -> Iterator[tuple[Tensor, Tensor]]:
    """Iterate over (x, y) mini-batches of ``split`` in the order of ``indices``.

    Args:
        split: Data split to draw from.
        indices: 1-D int64 tensor, e.g. from :func:`shard_indices`.
        batch_size: Examples per batch.
        drop_last: Drop the final incomplete batch.

    Returns:
        Iterator of (x, y) pairs.

    Raises:
        TypeError: If ``split`` or ``indices`` has the wrong type.
        ValueError: If ``indices`` is not 1-D or ``batch_size`` < 1.
    """
    if not isinstance(split, TensorSplit):
        raise TypeError(f"`split` must be a TensorSplit, got {type(split).__name__}")
    if not isinstance(indices, Tensor) or indices.dim() != 1:
        raise ValueError(f"`indices` must be a 1-D tensor, got {indices!r}")
    _check_int("batch_size", batch_size, 1)
    stop = len(indices) - len(indices) % batch_size if drop_last else len(indices)

    def gen() -> Iterator[tuple[Tensor, Tensor]]:
        for start in range(0, stop, batch_size):
            idx = indices[start:start + batch_size]
            yield split.x[idx], split.y[idx]

    return gen()
