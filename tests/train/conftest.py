"""Fixtures of the runner tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


def _snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``root``: its bytes and modification time (ns)."""
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def snapshot() -> Callable[[Path], dict[str, tuple[bytes, int]]]:
    """``snapshot(dir)``: the contents and times of every file under ``dir``, to show that a
    refused run left a directory exactly as it was."""
    return _snapshot
