"""Whether the hook state's engine is inside a step, and readers that wait for it to close.

Why: a checkpoint thread that reads the state while the communication thread (or autograd)
runs the next step's buckets would get one step's residuals beside another's warm starts or
byte counts. The step opens at its first bucket's work and closes after its last's; readers
wait for it to close and hold the gate while they read, so the next step waits for them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["StepGate"]


class StepGate:
    """The open/closed state of the engine's step, guarded by a condition."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._open = False

    @property
    def is_open(self) -> bool:
        """Whether a step is in progress (read without waiting: for display only)."""
        return self._open

    def open(self) -> None:
        """A bucket's work begins (waits while a reader holds the gate)."""
        with self._cv:
            self._open = True

    def close(self) -> None:
        """The step ended (its last bucket's work, or an abandoned step): wake the readers."""
        with self._cv:
            self._open = False
            self._cv.notify_all()

    @contextmanager
    def between_steps(self, hook_thread: int | None, *, counters: bool = False) -> Iterator[None]:
        """Wait for the step to close, then hold the next step off while the caller reads or
        writes the state (from any thread).

        Args:
            hook_thread: the thread that runs the steps (DDP calls the hook on it), if known.
            counters: a read on that thread itself (a gradient hook in the middle of the
                backward pass) gets the counts made so far instead of an error.

        Raises:
            RuntimeError: called inside a step on the thread that runs it, without
                ``counters`` (waiting would never end: that thread is the one to close it).
        """
        with self._cv:
            own_step = self._open and threading.get_ident() == hook_thread
            if own_step and not counters:
                raise RuntimeError(
                    "the hook state must be read between steps, not inside one (a backward "
                    "pass that stopped after some of its buckets leaves its step open)"
                )
            if not own_step:
                self._cv.wait_for(lambda: not self._open)
            yield
