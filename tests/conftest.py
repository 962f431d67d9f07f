"""Fixtures shared across test folders."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest


@pytest.fixture
def fake_cifar(tmp_path: Path) -> Path:
    """A tiny CIFAR-10 python release (two data batches of 24 images, a test batch of 16)."""
    release = tmp_path / "data" / "cifar-10-batches-py"
    release.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, n in (("data_batch_1", 24), ("data_batch_2", 24), ("test_batch", 16)):
        batch = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                 b"labels": [int(v) for v in rng.integers(0, 10, n)]}
        (release / name).write_bytes(pickle.dumps(batch))
    return release
