"""The communication thread behind the asynchronous DDP hook, and the group it talks on.

DDP calls the comm hook on its autograd thread, once per bucket, in bucket-index order on
every rank. The asynchronous hook hands each bucket's work (compensate, compress, exchange,
decode) to one thread per process, which runs the work in the order it arrived; so every
rank issues the same sequence of collectives while autograd goes on computing later buckets.

Why one thread per process and one *private* process group:

* **Order comes from one queue, never from blocking or callbacks.** Nothing waits inside a
  ``Future.then()`` callback (on gloo that blocks the process group's own worker threads,
  which is how PyTorch's ``powerSGD_hook`` deadlocks with several buckets).
* **A collective's order is per process group, across all threads of a process.** DDP itself
  all-reduces its unused-parameter map from the autograd thread right after the last bucket's
  hook returns, ``SyncBatchNorm`` all-reduces inside the backward pass, and user code may do
  anything between steps. Were the thread to share their group, each rank could interleave
  the two threads' calls differently and pair mismatched collectives (garbage or a hang). So
  the thread talks on its own copy of the group (same ranks, same order, same backend and
  timeout), made once per parent group when its first bucket arrives, which every member
  reaches in the same order.
* **CUDA.** The hook records an event on the autograd thread's current stream; the thread's
  own stream waits on it, runs the work and completes the future with that stream current,
  so the future's consumer (DDP's end of backward) waits on the right stream; the hook's
  host synchronisations (``.item()``, sizes) stall this thread, not the one launching
  backward kernels.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CommThread", "comm_thread", "private_group"]

log = logging.getLogger(__name__)

_CLOSE_TIMEOUT_S = 10.0


class _Task:
    __slots__ = ("device", "event", "fn", "future")

    def __init__(self, fn: Callable[[], torch.Tensor], device: torch.device,
                 future: torch.futures.Future, event: Any) -> None:
        self.fn, self.device, self.future, self.event = fn, device, future, event


class CommThread:
    """A daemon thread that runs submitted work in submission order (started lazily).

    Idle, it holds no tensor, so a process can exit or destroy its process groups between
    steps; at interpreter exit it is stopped (and joined) before daemon threads are frozen.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: collections.deque[_Task | None] = collections.deque()
        self._unfinished = 0
        self._thread: threading.Thread | None = None
        self._streams: dict[torch.device, Any] = {}

    # -- the caller's side -----------------------------------------------------------------
    def submit(self, fn: Callable[[], torch.Tensor], device: torch.device) -> torch.futures.Future:
        """Queue ``fn`` (run on this thread, in order); its result or exception completes the
        returned future. On CUDA, ``fn`` sees everything queued so far on the caller's
        current stream, and the future's consumers wait for ``fn``'s kernels."""
        event = None
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            future: torch.futures.Future = torch.futures.Future(devices=[device])
        else:
            future = torch.futures.Future()
        with self._cond:
            self._start_locked()
            self._queue.append(_Task(fn, device, future, event))
            self._unfinished += 1
            self._cond.notify_all()
        # A future completed by ``set_exception`` holds the exception as its *value*: C++
        # consumers such as DDP's reducer would report "Unable to cast ... to Tensor". A
        # callback that raises marks the chained future failed for real, with the original
        # message. It runs when the thread completes ``future``; it neither waits nor issues
        # anything.
        return future.then(_value_or_raise)

    def drain(self) -> None:
        """Wait until every submitted task has finished (a no-op on this thread itself); on
        CUDA the caller's current streams then also wait for the thread's kernels."""
        if threading.current_thread() is self._thread:
            return
        with self._cond:
            while self._unfinished:
                if self._thread is None or not self._thread.is_alive():
                    break  # stopped (interpreter exit): nothing more will finish
                self._cond.wait(timeout=1.0)
            streams = list(self._streams.items())
        for device, stream in streams:
            torch.cuda.current_stream(device).wait_stream(stream)

    def close(self, timeout: float = _CLOSE_TIMEOUT_S) -> None:
        """Let the queued tasks finish, then stop the thread (waiting up to ``timeout`` s)."""
        with self._cond:
            thread = self._thread
            if thread is None or not thread.is_alive():
                return
            self._queue.append(None)
            self._cond.notify_all()
        thread.join(timeout)
        if thread.is_alive():
            log.warning("gradzip's DDP communication thread did not stop within %g s", timeout)

    def _start_locked(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._thread = threading.Thread(target=self._run, name="gradzip-ddp-comm", daemon=True)
        self._thread.start()

    # -- the thread's side -----------------------------------------------------------------
    def _stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                task = self._queue.popleft()
            if task is None:
                return
            try:
                self._execute(task)
            finally:
                # Drop every reference before sleeping again: an idle thread holds no tensor.
                task = None
                with self._cond:
                    self._unfinished -= 1
                    self._cond.notify_all()

    def _execute(self, task: _Task) -> None:
        try:
            if task.event is None:
                with torch.no_grad():
                    result = task.fn()
                task.future.set_result(result)
                return
            stream = self._stream(task.device)
            with torch.cuda.device(task.device), torch.cuda.stream(stream), torch.no_grad():
                stream.wait_event(task.event)
                result = task.fn()
                # Completed with the side stream current: the future records an event there
                # and its consumers' streams wait on it.
                task.future.set_result(result)
        except BaseException as exc:  # noqa: BLE001 - every error reaches the waiting rank
            if not task.future.done():
                task.future.set_exception(exc)
            else:
                log.exception("gradzip's DDP communication thread failed after completing a bucket")


def _value_or_raise(future: torch.futures.Future) -> Any:
    return future.wait()


_THREAD = CommThread()


def comm_thread() -> CommThread:
    """The process's communication thread (one per process: one queue orders everything)."""
    return _THREAD


def _reset_after_fork() -> None:
    # A forked child (a data-loader worker) inherits the object but not the thread or a
    # consistent lock; it starts afresh if it ever submits work.
    global _THREAD
    _THREAD = CommThread()


os.register_at_fork(after_in_child=_reset_after_fork)
atexit.register(lambda: _THREAD.close())


# -- the private group ----------------------------------------------------------------------
_GROUPS: dict[int, tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}
_GROUPS_LOCK = threading.Lock()


def _group_timeout(group: dist.ProcessGroup) -> Any:
    """The parent group's collective timeout (``None``: the backend's default)."""
    for device_type in ("cuda", "cpu"):
        try:
            return group._get_backend(torch.device(device_type)).options._timeout
        except Exception:  # noqa: BLE001 - no such backend, or an older torch without it
            continue
    return None


def _alive(group: dist.ProcessGroup) -> bool:
    try:
        dist.get_process_group_ranks(group)
    except Exception:  # noqa: BLE001 - destroyed with destroy_process_group
        return False
    return True


def private_group(parent: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """This process's private copy of ``parent`` (``None``: the world group), made on first
    use: the same ranks in the same order, backend and timeout. Every member must call this
    for the same parents in the same order (the first bucket of each hook does).

    Raises:
        RuntimeError: no process group is initialised.
    """
    if not dist.is_initialized():
        raise RuntimeError("the asynchronous DDP hook needs an initialised process group")
    parent = dist.group.WORLD if parent is None else parent
    with _GROUPS_LOCK:
        cached = _GROUPS.get(id(parent))
        if cached is not None and cached[0] is parent and _alive(cached[1]):
            return cached[1]
        ranks = dist.get_process_group_ranks(parent)
        everyone = len(ranks) == dist.get_world_size()
        kwargs: dict[str, Any] = {
            "timeout": _group_timeout(parent),
            "backend": dist.get_backend(parent),
            # A group over a subset is made by its members alone (the others never run
            # this hook); the world's copy by everyone, with an ordinary sequential name.
            "use_local_synchronization": not everyone,
        }
        if ranks != sorted(ranks):
            kwargs["sort_ranks"] = False  # keep each rank's position (its residuals' owner)
        group = dist.new_group(ranks, **kwargs)
        _GROUPS[id(parent)] = (parent, group)
        return group
