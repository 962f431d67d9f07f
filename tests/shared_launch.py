"""Worker functions of several test modules in one launch of gloo processes per world size.

Starting gloo processes (each imports torch) costs more than most multi-process scenarios. A
module registers its worker at import, before any test runs; the first test that asks for a
world size's results runs every worker registered for that size not run yet, one after the
other, in one set of processes. Each worker gets the world process group, its own arguments
and folder, and the thread count it would start with alone; it runs in processes that ran the
workers registered before it (each worker builds its own models, engines and meshes). A worker
whose ranks fail apart, leaving collectives unpaired, stalls those after it until the launch's
limit: such a worker runs ``last``, or in a launch of its own.

A worker is a module-level function ``fn(rank, world, *args)`` (it pickles into the spawned
processes) whose return value pickles too. Workers written for ``ddp_helpers.spawn`` (which
sets one thread) are registered with ``threads=1``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from gradzip.comm import run_processes

__all__ = ["folder", "register", "results"]


@dataclass(frozen=True)
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    with_folder: bool | type
    timeout: float
    threads: int | None
    last: bool


_JOBS: dict[int, dict[str, _Job]] = {}
_DONE: dict[int, dict[str, list[Any]]] = {}
_FOLDERS: dict[tuple[int, str], str] = {}


def register(world: int, key: str, fn: Callable[..., Any], *args: Any,
             with_folder: bool | type = False, timeout: float = 240.0,
             threads: int | None = None, last: bool = False) -> None:
    """Run ``fn(rank, world, *args)`` in the shared launch of ``world`` processes.

    ``with_folder``: a fresh folder's path appended to ``args`` (a ``str``, or ``Path`` when
    it is ``Path``); ``timeout``: what it would get launched alone; ``threads``: the thread
    count it runs with (by default the one a fresh process starts with); ``last``: it runs
    after every other worker of its launch (one whose ranks leave the group unpaired)."""
    job = _Job(fn, args, with_folder, timeout, threads, last)
    if last and any(other.last for k, other in _JOBS.get(world, {}).items() if k != key):
        raise ValueError(f"another worker runs last at world {world}")
    jobs = _JOBS.setdefault(world, {})
    if jobs.get(key, job) != job:
        raise ValueError(f"`key` {key!r} is registered with another worker at world {world}")
    jobs[key] = job


def _worker(rank: int, world: int, jobs: dict[str, tuple[_Job, tuple[Any, ...]]]) -> dict[str, Any]:
    out = {}
    threads = torch.get_num_threads()
    for key, (job, args) in jobs.items():
        if job.threads is not None:
            torch.set_num_threads(job.threads)
        out[key] = job.fn(rank, world, *args)
        torch.set_num_threads(threads)  # as the next worker would find it in its own launch
    return out


def results(world: int, key: str,
            tmp_path_factory: pytest.TempPathFactory | None = None) -> list[Any]:
    """Worker ``key``'s return values on every rank of ``world`` processes, in rank order.
    Every worker registered at this size and not run yet runs now, in one launch; their
    folders come from ``tmp_path_factory`` (without one, from :func:`tempfile.mkdtemp`)."""
    done = _DONE.setdefault(world, {})
    if key not in done:
        missing = {k: job for k, job in _JOBS.get(world, {}).items() if k not in done}
        missing = dict(sorted(missing.items(), key=lambda item: item[1].last))  # stable
        if key not in missing:
            raise KeyError(f"no worker {key!r} is registered at world {world}")
        calls = {}
        for k, job in missing.items():
            args = job.args
            if job.with_folder:
                _FOLDERS[world, k] = (str(tmp_path_factory.mktemp(f"{k}-{world}"))
                                      if tmp_path_factory is not None
                                      else tempfile.mkdtemp(prefix=f"{k}-{world}-"))
                args = (*args, Path(_FOLDERS[world, k]) if job.with_folder is Path
                        else _FOLDERS[world, k])
            calls[k] = (job, args)
        # The longest worker's own limit, and a minute for each other one (a hang still
        # fails within minutes).
        timeout = max(job.timeout for job in missing.values()) + 60 * (len(missing) - 1)
        per_rank = run_processes(_worker, world, calls, timeout=timeout)
        for k in missing:
            done[k] = [ranks[k] for ranks in per_rank]
    return done[key]


def folder(world: int, key: str) -> Path:
    """The folder worker ``key`` got at ``world`` (once :func:`results` ran it)."""
    return Path(_FOLDERS[world, key])
