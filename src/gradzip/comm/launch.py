"""Run a function in N local processes joined by a gloo process group.

Used by the test suite and the runner's ``procs`` launcher; under ``torchrun`` the processes
already exist and this module is not involved. Workers die with their parent, however it
ends (SIGKILL included): an orphaned worker would go on training and writing into a run
directory that a new run may already be using.
"""

from __future__ import annotations

import ctypes
import io
import multiprocessing as mp
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradzip._validate import check_int, check_real

__all__ = ["die_with_parent", "free_port", "run_processes"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _watch_parent(parent: int, poll: float = 0.5) -> None:
    """Exit at once when the parent process ``parent`` is gone (its children are re-parented,
    so ``getppid`` changes); runs on a daemon thread where no parent-death signal exists."""
    while os.getppid() == parent:
        time.sleep(poll)
    os._exit(1)


def die_with_parent(parent: int) -> None:
    """Make this process end when the process ``parent`` (which started it) ends.

    On Linux the kernel sends SIGKILL the moment the parent exits (``prctl(PR_SET_PDEATHSIG)``);
    elsewhere a daemon thread polls the parent's pid. Either way the parent may already have
    died before this call, which the pid check after it catches.
    """
    armed = False
    # The kernel ties the signal to the *thread* that started this process, not to the whole
    # parent; run_processes starts and waits for its workers in one thread, which therefore
    # outlives them unless the parent itself dies.
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
            armed = False
    if not armed:  # pragma: no cover - exercised on macOS and other platforms
        threading.Thread(target=_watch_parent, args=(parent,), name="gradzip-parent-watch",
                         daemon=True).start()
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


def _entry(
    parent: int,
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout: float,
    args: tuple[Any, ...],
    results: Any,
) -> None:
    die_with_parent(parent)
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        try:
            value = fn(rank, world_size, *args)
        finally:
            if dist.is_initialized():  # ``fn`` may have shut the group down itself
                dist.destroy_process_group()
            # Let gloo's worker threads release the last collective's tensors before this
            # process may exit (see ``shutdown_process_group``).
            time.sleep(0.05)
        # Plain bytes: tensors put on a queue directly travel as shared-memory handles that
        # die with this process, which may exit before the parent reads them.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        results.put((rank, False, traceback.format_exc()))


def run_processes(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120.0,
    return_exceptions: bool = False,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes.

    Each process joins a process group on 127.0.0.1 before ``fn`` runs and leaves it after.
    ``fn`` and ``args`` must be picklable (a module-level function). The workers die with
    the calling process, even when it is killed with SIGKILL (:func:`die_with_parent`).

    Args:
        fn: the worker function; its return value must be picklable.
        world_size: number of processes (>= 1).
        *args: extra arguments for ``fn``.
        backend: ``"gloo"`` (CPU) or ``"nccl"``.
        timeout: seconds for the whole run and for each collective; on expiry every process
            is terminated and ``TimeoutError`` raised, so a hang never blocks the caller.
        return_exceptions: instead of raising on a worker's failure, wait for every worker
            and return a ``RuntimeError`` in the place of each one that raised or died.

    Returns:
        ``fn``'s return values in rank order.

    Raises:
        RuntimeError: a worker raised (its traceback is included).
        TimeoutError: the workers did not finish in time.
    """
    world_size = check_int("world_size", world_size, minimum=1)
    timeout = check_real("timeout", timeout, low=0, low_open=True)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_entry,
            args=(os.getpid(), fn, rank, world_size, port, backend, timeout, args, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    out: dict[int, Any] = {}
    try:
        while len(out) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"{world_size - len(out)} of {world_size} workers did not finish within "
                    f"{timeout:g} s"
                )
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                for r, proc in enumerate(procs):
                    if r not in out and proc.exitcode not in (None, 0):
                        error = RuntimeError(
                            f"worker {r} exited with code {proc.exitcode} before reporting"
                        )
                        if not return_exceptions:
                            raise error from None
                        out[r] = error
                continue
            if not ok:
                error = RuntimeError(f"worker {rank} failed:\n{value}")
                if not return_exceptions:
                    raise error
                out[rank] = error
                continue
            out[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for proc in procs:
            proc.join(timeout=5 if len(out) == world_size else 0.1)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
    return [out[r] for r in range(world_size)]
