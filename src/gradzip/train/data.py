"""Shared data layer for gradzip training: containers, digits, sharding, batching, augmentation.

Everything keeps whole data sets as tensors in RAM; only ``torch`` and ``numpy`` are needed.
The other data set loaders build on this module and live beside it (import them from there):

- :mod:`gradzip.train.cifar`: CIFAR-10 and 32x32 ImageFolder trees (decoding needs Pillow).
- :mod:`gradzip.train.text`: text corpora, ``batchify``, ``bptt_batches``.
- :mod:`gradzip.train.tabular`: LIBSVM files and a synthetic logistic-regression problem.
"""

from __future__ import annotations

import importlib.resources
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from gradzip._validate import check_int, check_real

__all__ = [
    "LMData",
    "PathLike",
    "TaskData",
    "TensorSplit",
    "augment_batch",
    "iter_batches",
    "load_digits",
    "shard_indices",
]

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]

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


def _check_path(name: str, value: Any) -> Path:
    """Validate a path argument that must name an existing file or directory.

    Shared by the loader modules; a path has no ``gradzip._validate`` counterpart.

    Raises:
        TypeError: ``value`` is not a str or ``os.PathLike``.
        ValueError: the path does not exist.
    """
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"`{name}` must be a str or os.PathLike, got {value!r}")
    path = Path(value).expanduser()
    if not path.exists():
        raise ValueError(f"`{name}` must be an existing path, got {str(value)!r}")
    return path


def _read_utf8(name: str, path: Path) -> str:
    """The text of ``path``, refusing a file that is not UTF-8 with a message naming the
    parameter and the file (instead of the codec's, which names neither).

    Raises:
        ValueError: ``path`` holds bytes that are not UTF-8, or cannot be read.
    """
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        byte = exc.object[exc.start]
        raise ValueError(f"`{name}` file {str(path)!r} must be UTF-8 text, got byte 0x{byte:02x} "
                         f"at offset {exc.start} ({exc.reason})") from None
    except OSError as exc:
        raise ValueError(f"`{name}` file {str(path)!r} must be readable, got "
                         f"{exc.strerror or exc}") from None


def _split_indices(n: int, test_fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    """Seeded train/test split of ``range(n)``: sorted train and test indices, each non-empty."""
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
    test_fraction = check_real("test_fraction", test_fraction, low=0, high=1,
                               low_open=True, high_open=True)
    seed = check_int("seed", seed, minimum=0)
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


# ---------------------------------------------------------------- augmentation


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
    pad = check_int("pad", pad, minimum=0)
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
    world_size = check_int("world_size", world_size, minimum=1)
    n = check_int("n", n, minimum=world_size)
    rank = check_int("rank", rank, minimum=0)
    if rank >= world_size:
        raise ValueError(f"`rank` must be < world_size={world_size}, got {rank}")
    epoch = check_int("epoch", epoch, minimum=0)
    seed = check_int("seed", seed, minimum=0)
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
    batch_size = check_int("batch_size", batch_size, minimum=1)
    stop = len(indices) - len(indices) % batch_size if drop_last else len(indices)

    def gen() -> Iterator[tuple[Tensor, Tensor]]:
        for start in range(0, stop, batch_size):
            idx = indices[start:start + batch_size]
            yield split.x[idx], split.y[idx]

    return gen()
