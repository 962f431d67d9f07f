"""Tabular classification data: LIBSVM files and a synthetic logistic-regression problem."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from gradzip._validate import check_int, check_real
from gradzip.train.data import (
    PathLike,
    TaskData,
    TensorSplit,
    _check_path,
    _read_utf8,
    _split_indices,
)

__all__ = ["load_libsvm", "make_logreg_problem"]


def _parse_libsvm(path: Path) -> tuple[list[float], list[dict[int, float]]]:
    labels: list[float] = []
    rows: list[dict[int, float]] = []
    for lineno, line in enumerate(_read_utf8("path", path).split("\n"), 1):
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
    seed = check_int("seed", seed, minimum=0)
    test_fraction = check_real("test_fraction", test_fraction, low=0, high=1,
                               low_open=True, high_open=True)
    parts = [_parse_libsvm(src)]
    if test_path is not None:
        parts.append(_parse_libsvm(_check_path("test_path", test_path)))
    max_index = max(max(r, default=0) for _, rows in parts for r in rows)
    if num_features is None:
        num_features = max(max_index, 1)
    else:
        num_features = check_int("num_features", num_features, minimum=1)
        if num_features < max_index:
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
    n = check_int("n", n, minimum=2)
    d = check_int("d", d, minimum=1)
    seed = check_int("seed", seed, minimum=0)
    test_fraction = check_real("test_fraction", test_fraction, low=0, high=1,
                               low_open=True, high_open=True)
    flip_prob = check_real("flip_prob", flip_prob, low=0, high=1, high_open=True)
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(d, generator=gen) / math.sqrt(d)
    x = torch.randn(n, d, generator=gen)
    flips = torch.rand(n, generator=gen) < flip_prob
    y = ((x @ w > 0) ^ flips).long()
    train_idx, test_idx = _split_indices(n, test_fraction, seed)
    meta = {"name": "synthetic-logreg", "w": w, "flip_prob": flip_prob}
    return TaskData(TensorSplit(x[train_idx], y[train_idx]),
                    TensorSplit(x[test_idx], y[test_idx]), 2, meta)
