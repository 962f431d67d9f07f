"""Which form of an op the CPU takes: its own fast form, or the one every other device takes.

A few ops have a form that runs only on the CPU (NumPy's bit packing and selection, the
compiled QSGD decoder, chunked loops that stay in cache) because it is faster there; on every
other device the same op is a whole-tensor torch form. Both forms give the same bits.
:func:`device_forms` makes the CPU take the other devices' forms for a while: how the tests
check those forms without a GPU, and how ``benchmarks/op_counts.py`` counts the ops a GPU
would launch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["cpu_form", "device_forms"]

#: Nesting depth of :func:`device_forms` (process-wide: the DDP hook's thread sees it too).
_forced = 0


def cpu_form(device: torch.device) -> bool:
    """Whether an op on ``device`` takes its CPU-only form: on the CPU, unless inside
    :func:`device_forms`."""
    return device.type == "cpu" and _forced == 0


@contextmanager
def device_forms() -> Iterator[None]:
    """Within this block, ops on the CPU take the form other devices take (process-wide;
    not for use while another thread relies on the CPU forms' speed).

    Examples:
        >>> with device_forms():
        ...     engine.reduce(grads)   # the ops a GPU would run, on the CPU
    """
    global _forced
    _forced += 1
    try:
        yield
    finally:
        _forced -= 1
