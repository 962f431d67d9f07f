"""Checks of received messages that do not make the host wait for the device.

A decoder that reads a received index or code on the host (``int(x.max())``, ``bool(...)``)
stalls a CUDA stream once per call: the host stops launching kernels until the device has
caught up. The checks here queue a device-side assertion instead (``torch._assert_async``):
on CUDA a failing check aborts the device's work at the point it is reached (the process then
fails with a device-side assertion naming the message below); on the CPU, where reading a
value costs nothing, it fails at once and raises the usual :class:`ValueError` with the
precise values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["check_on_device", "check_range"]


def check_on_device(ok: torch.Tensor, message: str, explain: Callable[[], str] | None = None) -> None:
    """Assert the 0-d boolean ``ok`` without a host read of its value on CUDA.

    Args:
        ok: a 0-d bool tensor, true when the message is well formed.
        message: what is wrong when it is not (the device-side assertion's text).
        explain: on the CPU, a function giving a more precise message (it may read values).

    Raises:
        ValueError: on the CPU, ``ok`` is false (on CUDA the device asserts instead).
    """
    if ok.device.type != "cpu":
        torch._assert_async(ok, message)
        return
    try:
        torch._assert_async(ok, message)
    except RuntimeError:
        raise ValueError(explain() if explain is not None else message) from None


def check_range(values: torch.Tensor, high: int, what: str) -> None:
    """Check that every entry of the integer tensor ``values`` lies in ``[0, high]``.

    Args:
        values: received indices or codes (any shape; empty passes).
        high: the largest allowed value.
        what: how the error names them, e.g. ``"message codes"``.

    Raises:
        ValueError: on the CPU, an entry lies outside (``"<what> must lie in [0, high], got v"``,
            with ``v`` the first bound crossed); on CUDA the device asserts instead.
    """
    if values.numel() == 0:
        return
    lo, hi = torch.aminmax(values)
    ok = (lo >= 0) & (hi <= high)

    def explain() -> str:
        bad = int(lo) if int(lo) < 0 else int(hi)
        return f"{what} must lie in [0, {high}], got {bad}"

    check_on_device(ok, f"{what} must lie in [0, {high}]", explain)
