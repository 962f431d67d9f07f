"""What every benchmark shares: a fixed allocator regime, a median timer, the machine's description."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["HEAP_MODES", "Heap", "environment", "median_seconds"]

log = logging.getLogger(__name__)

HEAP_MODES = ("warm", "default")
# glibc's mallopt parameters (malloc.h) and the largest mmap threshold its dynamic rule reaches.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_MMAP_THRESHOLD_MAX = 32 << 20


class Heap:
    """Makes the cost of large allocations the same for every timed call.

    With glibc, whether a new buffer costs fresh pages (page faults) depends on history: its
    mmap threshold moves with what was freed before. Two fixed regimes instead:

    * ``"warm"``: freed memory is kept and reused (no ``mmap``, no trimming), as a caching
      allocator would: timings show the kernels and memory bandwidth.
    * ``"default"``: glibc's long-run default, fixed: buffers of 32 MiB and more are fresh
      pages from ``mmap`` on every allocation; smaller ones reuse heap memory.

    Either changes this process's allocator for good: run it in a process of its own. Off
    glibc neither is available and the mode is reported as ``"unmanaged"``.
    """

    def __init__(self, mode: str) -> None:
        if mode not in HEAP_MODES:
            raise ValueError(f"`heap` must be one of {', '.join(HEAP_MODES)}, got {mode!r}")
        libc = None
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        except OSError:  # pragma: no cover - not glibc
            pass
        if libc is None or not hasattr(libc, "mallopt"):  # pragma: no cover - not glibc
            log.warning("heap mode %r needs glibc; allocations are left unmanaged", mode)
            self.mode = "unmanaged"
            return
        self.mode = mode
        if mode == "warm":
            libc.mallopt(_M_MMAP_MAX, 0)
            libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
        else:
            libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
            libc.mallopt(_M_TRIM_THRESHOLD, 2 * _MMAP_THRESHOLD_MAX)


def median_seconds(fn: Callable[[], object], repeat: int, warmup: int = 1) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeat`` calls, after ``warmup`` calls.

    Args:
        fn: the work to time (its result is dropped before the next call).
        repeat: timed calls (>= 1).
        warmup: untimed calls first (page faults, lazy initialisation, caches).

    Returns:
        The median duration in seconds.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def environment(threads: int) -> dict[str, Any]:
    """What a reader needs to judge a figure: versions, threads, cores and load right now."""
    try:
        load = [round(v, 2) for v in os.getloadavg()]
    except OSError:  # pragma: no cover - not on every platform
        load = None
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": threads,
        "cpus": os.cpu_count(),
        "load_average": load,
        "machine": platform.machine(),
    }
