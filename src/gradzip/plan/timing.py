"""Compression time: measured once per device by a micro-benchmark, cached in a JSON file.

:func:`measure_compress_seconds` times what a DDP hook's engine does with one bucket holding
the whole model, for one worker (a group of one: compression, decoding and the engine's own
work; no link): the CPU time of the measuring thread with torch on one thread, the fastest of a
few repeats after a warm-up. CPU time rather than the wall clock, so that other processes on a
shared machine do not inflate it. :class:`TimingCache` keeps the results in a small
JSON file, keyed by the spec, the shapes, the device and the torch version, so a later plan on
the same machine does not measure again. The file is ``$GRADZIP_PLAN_TIMINGS`` if set, else
``plan-timings.json`` under ``$XDG_CACHE_HOME/gradzip`` (``~/.cache/gradzip``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from gradzip._validate import check_int
from gradzip.comm.simulated import SingleWorker
from gradzip.engine import Engine

__all__ = ["ENV_VAR", "TimingCache", "default_cache_path", "measure_compress_seconds",
           "timing_key", "write_json_atomically"]

#: The environment variable naming the cache file.
ENV_VAR = "GRADZIP_PLAN_TIMINGS"

_FORMAT = 1


def default_cache_path() -> Path:
    """``$GRADZIP_PLAN_TIMINGS``, else ``plan-timings.json`` in the user's cache directory."""
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "gradzip" / "plan-timings.json"


def timing_key(spec: str, shapes: Mapping[str, tuple[int, ...]], device: str = "cpu") -> str:
    """The cache key of one measurement: spec, a digest of the shapes, device, torch version."""
    text = ";".join(f"{n}={','.join(map(str, s))}" for n, s in sorted(shapes.items()))
    digest = hashlib.sha1(text.encode()).hexdigest()[:16]
    return f"{spec}|{digest}|{device}|torch {torch.__version__}"


def measure_compress_seconds(spec: str, shapes: Mapping[str, tuple[int, ...]], *,
                             repeats: int = 3, seed: int = 0) -> float:
    """Seconds one worker spends in one engine step of ``spec`` on tensors of ``shapes``.

    Args:
        spec: a compressor spec.
        shapes: ``name -> shape``.
        repeats: timed steps after one warm-up step (>= 1); the fastest is returned.
        seed: seed of the random gradients.

    Returns:
        CPU seconds of one worker's step.
    """
    repeats = check_int("repeats", repeats, minimum=1)
    params = {name: torch.zeros(shape) for name, shape in shapes.items()}
    engine = Engine(params, spec, collective=SingleWorker())
    gen = torch.Generator().manual_seed(seed)
    buffer = torch.randn(sum(math.prod(s) for s in shapes.values()), generator=gen)
    named, offset = {}, 0
    for name, shape in shapes.items():
        named[name] = buffer[offset:offset + math.prod(shape)].view(shape)
        offset += math.prod(shape)
    layout = engine.bucket_layout(named, buffer)
    source = buffer.clone()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times = []
    try:
        for i in range(repeats + 1):
            buffer.copy_(source)
            start = time.thread_time()
            engine.reduce_bucket(layout, finish_step=True)
            if i:  # the first step allocates and compiles
                times.append(time.thread_time() - start)
    finally:
        torch.set_num_threads(threads)
    return min(times)


class TimingCache:
    """Measured compression times, read from and written to one JSON file.

    Args:
        path: the file (default :func:`default_cache_path`); created on the first write.

    Raises:
        ValueError: the file exists but is not a timing cache.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"`path` must be a path, got {path!r}")
        self.path = Path(path).expanduser() if path is not None else default_cache_path()
        self.entries: dict[str, float] = {}
        if self.path.exists():
            self.entries = _read(self.path)

    def get(self, key: str) -> float | None:
        """The cached seconds of ``key``, or ``None``."""
        return self.entries.get(key)

    def put(self, key: str, seconds: float) -> None:
        """Record ``seconds`` under ``key`` and write the file (atomically)."""
        self.entries[key] = float(seconds)
        write_json_atomically(self.path, {"format": _FORMAT, "seconds": self.entries}, indent=1)

    def seconds(self, spec: str, shapes: Mapping[str, tuple[int, ...]], *,
                measure: bool = True) -> float | None:
        """The compression time of ``spec`` on ``shapes``: cached, else measured and cached
        (with ``measure``), else ``None``."""
        key = timing_key(spec, shapes)
        found = self.get(key)
        if found is None and measure:
            found = measure_compress_seconds(spec, shapes)
            self.put(key, found)
        return found


def write_json_atomically(path: Path, data: Any, indent: int | None = None) -> None:
    """Write ``data`` as JSON to ``path`` (its folder made if missing) by a rename, so that a
    reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A name of this process's own: two processes writing at once (two workers, two plans)
    # would otherwise move each other's half-written file into place.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=indent, sort_keys=True))
    tmp.replace(path)


def _read(path: Path) -> dict[str, float]:
    try:
        data: Any = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"`timings` must be a gradzip plan timing file, got {str(path)!r} "
                         f"({exc})") from None
    ok = (isinstance(data, dict) and data.get("format") == _FORMAT
          and isinstance(data.get("seconds"), dict)
          and all(isinstance(v, (int, float)) and v >= 0 for v in data["seconds"].values()))
    if not ok:
        raise ValueError(f"`timings` must be a gradzip plan timing file, got {str(path)!r}")
    return {str(k): float(v) for k, v in data["seconds"].items()}
