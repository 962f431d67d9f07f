"""Simulated exchanges kept on disk, so that a later run on the machine does not simulate again.

:func:`~gradzip.plan.traffic.measure_traffic` runs the real compressor in the simulator; for a
model of some millions of parameters that takes a fraction of a second per spec, and a run that
decides how to communicate before its first step (``gradzip train --auto-outer``) simulates
every level and candidate there, on every worker. What a simulation finds is a function of the
spec, ``W``, the shapes and gradzip's own code alone, so it is kept in a JSON file keyed by all
four: the code by a digest of the package's source, so that a changed compressor is simulated
afresh rather than read back stale.

The file is ``plan-traffic.json`` beside the compression-time cache
(:func:`~gradzip.plan.timing.default_cache_path`: ``$GRADZIP_PLAN_TIMINGS``'s folder, else
``~/.cache/gradzip``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gradzip.plan.timing import default_cache_path, write_json_atomically
from gradzip.plan.traffic import DEFAULT_LIMIT, Call, Traffic, measure_traffic

__all__ = ["TrafficCache", "code_digest", "default_traffic_path", "stored_or_simulated",
           "traffic_key"]

log = logging.getLogger(__name__)

_FORMAT = 1
_KINDS = ("all_reduce", "all_gather", "all_to_all")


def default_traffic_path() -> Path:
    """``plan-traffic.json`` in the folder of the compression-time cache."""
    return default_cache_path().with_name("plan-traffic.json")


@functools.cache
def code_digest() -> str:
    """A digest of gradzip's Python source (file names and bytes), computed once per process:
    any change to a compressor, the engine or the byte meter gives new keys."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha1()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def traffic_key(spec: str, workers: int, shapes: Mapping[str, Sequence[int]]) -> str:
    """The cache key of one simulated exchange: spec, ``W``, a digest of the shapes (names in
    order: the engine lays a call out in that order), the simulation's limit and the code."""
    text = ";".join(f"{n}={','.join(str(int(d)) for d in s)}" for n, s in shapes.items())
    shape_digest = hashlib.sha1(text.encode()).hexdigest()[:16]
    return f"{spec}|W={workers}|{shape_digest}|limit={DEFAULT_LIMIT}|code {code_digest()}"


class TrafficCache:
    """Simulated exchanges (:class:`~gradzip.plan.traffic.Traffic`), read from and written to
    one JSON file.

    Args:
        path: the file (default :func:`default_traffic_path`); created on the first write.

    Raises:
        TypeError: ``path`` is not a path.
        ValueError: the file exists but is not a traffic cache.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"`path` must be a path, got {path!r}")
        self.path = Path(path).expanduser() if path is not None else default_traffic_path()
        self.entries: dict[str, Traffic] = _read(self.path) if self.path.exists() else {}

    def get(self, key: str) -> Traffic | None:
        """The cached exchange of ``key``, or ``None``."""
        return self.entries.get(key)

    def put(self, key: str, traffic: Traffic) -> None:
        """Record ``traffic`` under ``key`` and write the file (atomically:
        :func:`~gradzip.plan.timing.write_json_atomically`)."""
        self.entries[key] = traffic
        write_json_atomically(self.path, {"format": _FORMAT, "traffic": {
            k: _encode(t) for k, t in self.entries.items()}})

    def traffic(self, spec: str, workers: int, shapes: Mapping[str, Sequence[int]]) -> Traffic:
        """One exchange of ``spec`` among ``workers`` on tensors of ``shapes``: cached, else
        simulated (:func:`~gradzip.plan.traffic.measure_traffic`) and cached; a file that
        cannot be written is passed over with a warning (the simulation is returned)."""
        key = traffic_key(spec, workers, shapes)
        found = self.get(key)
        if found is None:
            found = stored_or_simulated(spec, workers, shapes, None)
            try:
                self.put(key, found)
            except OSError as exc:
                log.warning("simulated traffic not cached (%s)", exc)
        return found


def stored_or_simulated(spec: str, workers: int, shapes: Mapping[str, Sequence[int]],
                        store: TrafficCache | None) -> Traffic:
    """One exchange of ``spec``: from ``store`` (:meth:`TrafficCache.traffic`) where one is
    given, else simulated (:func:`~gradzip.plan.traffic.measure_traffic`)."""
    if store is not None:
        return store.traffic(spec, workers, shapes)
    return measure_traffic(spec, workers, shapes={n: tuple(int(d) for d in s)
                                                  for n, s in shapes.items()})


def _encode(traffic: Traffic) -> dict[str, Any]:
    return {"workers": traffic.workers, "exact": traffic.exact,
            "calls": [[c.kind, c.nbytes, c.payload] for c in traffic.calls]}


def _decode(entry: Any) -> Traffic:
    calls = entry["calls"]
    if not (isinstance(entry["workers"], int) and entry["workers"] >= 1
            and isinstance(entry["exact"], bool) and isinstance(calls, list)):
        raise ValueError(entry)
    out = []
    for kind, nbytes, payload in calls:
        if kind not in _KINDS or not all(isinstance(v, int) and v >= 0 for v in (nbytes, payload)):
            raise ValueError(entry)
        out.append(Call(kind, nbytes, payload))
    return Traffic(entry["workers"], tuple(out), entry["exact"])


def _read(path: Path) -> dict[str, Traffic]:
    try:
        data: Any = json.loads(path.read_text())
        if not (isinstance(data, dict) and data.get("format") == _FORMAT
                and isinstance(data.get("traffic"), dict)):
            raise ValueError("no traffic table")
        return {str(k): _decode(v) for k, v in data["traffic"].items()}
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"`path` must be a gradzip plan traffic file, got {str(path)!r} "
                         f"({exc!r})") from None
