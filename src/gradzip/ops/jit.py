"""Optional compiled CPU kernels (Numba): one pass over memory where NumPy and ATen need several.

Installed with the ``fast`` extra (``pip install -e '.[fast]'`` in a clone, or ``pip install numba``). Without Numba, with
``GRADZIP_JIT=0`` in the environment, or on a big-endian CPU, :func:`enabled` is false and
callers use their NumPy and torch paths, which give the same bits. Kernels (in
:mod:`gradzip.ops._jit_kernels`) are compiled on first use (seconds, once: then cached on
disk next to that module where it is writable, and loaded by later processes) and release
the GIL.

* :func:`threshold_split_chunk`: the hard threshold's selection and residual in one pass.
* :func:`qsgd_sum`: QSGD's average of every worker's packed codes, unpacked and accumulated
  in cache-sized blocks, never stored as a tensor of codes.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import sys
from typing import Any

import numpy as np

__all__ = ["enabled", "qsgd_sum", "threshold_split_chunk"]

log = logging.getLogger(__name__)


def enabled() -> bool:
    """Whether the compiled kernels are used: Numba is installed, the CPU is little-endian
    (QSGD's kernel reads packed bytes as little-endian words) and ``GRADZIP_JIT`` is not
    ``0``. Read at every call, so a process can compare both paths."""
    return os.environ.get("GRADZIP_JIT", "1") != "0" and sys.byteorder == "little" and _installed()


@functools.cache
def _installed() -> bool:
    """Whether Numba is installed and imports (it is imported at the first call, not with
    ``import gradzip``, which stays fast); a broken install is logged and left alone."""
    if importlib.util.find_spec("numba") is None:
        return False
    try:
        _kernels()
    except Exception as err:  # pragma: no cover - depends on the environment
        log.warning("numba is installed but unusable (%s); using the NumPy and torch paths", err)
        return False
    return True


@functools.cache
def _kernels() -> dict[str, Any]:  # pragma: no cover - compiled code is not traced
    """The kernels (compiled at their first call in a process, or loaded from Numba's disk
    cache, which :mod:`gradzip.ops._jit_kernels` keeps valid across processes)."""
    from gradzip.ops import _jit_kernels

    return {"split": _jit_kernels.split, "qsgd": _jit_kernels.qsgd}


def threshold_split_chunk(
    x: np.ndarray, below: float, rest: np.ndarray, idx: np.ndarray, val: np.ndarray, base: int
) -> int:
    """Writes ``rest = 0 where |x| > below else x`` and the selected entries, in one pass.

    Args:
        x: 1-D float32 or float64 chunk (contiguous).
        below: the comparison bound (the largest float under the threshold, so ``|x| > below``
            is ``|x| >= threshold``); NaN is never selected and stays in ``rest``.
        rest: like ``x``; receives the residual.
        idx: int64 buffer of at least ``len(x)`` entries; receives ``base + position`` of each
            selected entry, ascending.
        val: buffer like ``x`` of at least ``len(x)`` entries; receives the selected values.
        base: added to every position written to ``idx``.

    Returns:
        How many entries were selected (the filled prefix of ``idx`` and ``val``).
    """
    kind = x.dtype.type
    return int(_kernels()["split"](x, kind(below), kind(0), rest, idx, val, base))


def _stages(bits: int) -> np.ndarray:
    """The three (shift, high mask, low mask) stages spreading eight ``bits``-bit fields of a
    little-endian 64-bit word to one byte each (as in :mod:`gradzip.ops.bits`)."""
    quad = (1 << (4 * bits)) - 1
    pair = ((1 << (2 * bits)) - 1) * (1 | 1 << 32)
    one = ((1 << bits) - 1) * (1 | 1 << 16 | 1 << 32 | 1 << 48)
    return np.array(
        [32 - 4 * bits, quad << 32, quad, 16 - 2 * bits, pair << 16, pair, 8 - bits, one << 8, one],
        dtype=np.uint64,
    )


def qsgd_sum(
    packed: np.ndarray, bits: int, first: int, count: int, size: int,
    steps: np.ndarray, offsets: np.ndarray, divisor: int,
) -> tuple[np.ndarray, int]:
    """The average of QSGD messages over rows, straight from the packed codes.

    Entry ``j`` of the result is ``(sum over rows r, in order, of code[r, first + j] *
    steps[r, j // size]) - offsets[j // size]``, divided by ``divisor``, accumulated in float32
    with one fused multiply-add per row (as ``addcmul_`` computes it).

    Args:
        packed: uint8 ``[R, need]``, each row a stream of ``bits``-bit codes packed as by
            :func:`gradzip.ops.bits.pack_bits` (unit stride along a row).
        bits: code width, 2 to 7.
        first: the stream position of the tensor's first code.
        count: the tensor's entries.
        size: entries per bucket (one step and offset each).
        steps: float32 ``[R, buckets]``, each row's norm over the number of levels.
        offsets: float32 ``[buckets]``, the sum of the norms over rows.
        divisor: the world size.

    Returns:
        ``(average float32 [count], the largest code of the tensor)``.
    """
    assert 2 <= bits <= 7 and packed.dtype == np.uint8 and packed.strides[1] == 1
    rows, need = packed.shape
    groups = -(-(first + count) // 8)
    # Word g of row r is the 8 bytes from byte g * bits. A read may run up to 7 bytes past the
    # row's codes; that is inside the array's memory except near the end of its last rows,
    # whose last words (from ``safe``) the kernel assembles byte by byte instead.
    row_stride = packed.strides[0] if rows > 1 else need
    last_ok = (need - 8) // bits + 1 if need >= 8 else 0
    safe = np.array(
        [groups if (rows - 1 - r) * row_stride >= 8 else last_ok for r in range(rows)],
        dtype=np.int64,
    )
    win = _windows(packed, groups, bits)
    out = np.empty(count, dtype=np.float32)
    top = _kernels()["qsgd"](
        win, packed, safe, bits, _stages(bits), first, count, size,
        np.ascontiguousarray(steps, dtype=np.float32),
        np.ascontiguousarray(offsets, dtype=np.float32), np.float32(divisor), out,
    )
    return out, int(top)


def _windows(packed: np.ndarray, groups: int, bits: int) -> np.ndarray:
    """uint64 ``[R, groups]`` view: element ``[r, g]`` is the (unaligned) 8 bytes from byte
    ``g * bits`` of row ``r``. Its extent may pass the end of ``packed``: only the words that
    :func:`qsgd_sum` marks safe are read."""

    class _View:  # an array interface, as NumPy's as_strided builds one, with another dtype
        def __init__(self) -> None:
            self.base = packed
            self.__array_interface__ = {
                "data": (packed.__array_interface__["data"][0], True),
                "shape": (packed.shape[0], groups),
                "strides": (packed.strides[0], bits),
                "typestr": "<u8",
                "version": 3,
            }

    return np.asarray(_View())
