"""Optional compiled CPU kernels (Numba): one pass over memory where NumPy and ATen need several.

Installed with the ``fast`` extra (``pip install -e '.[fast]'`` in a clone, or ``pip install numba``). Without Numba, with
``GRADZIP_JIT=0`` in the environment, or on a big-endian CPU, :func:`enabled` is false and
callers use their NumPy and torch paths, which give the same bits. Kernels are compiled on
first use (about a second each, then cached on disk next to this module where it is
writable) and release the GIL.

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


#: Entries of one block of QSGD's kernel: 8192 (32 KiB of sums) stay in the L1/L2 cache while
#: every worker's codes are added into them.
_BLOCK_GROUPS = 1024
#: Entries of the threshold kernel's inner block: one vectorised loop writes the residual and
#: a 64-bit mask of the hits, whose set bits are then visited in order.
_SPLIT_BLOCK = 64


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
    """Compiles (once per process; Numba's disk cache makes later processes fast) and returns
    the kernels."""
    import numba
    from numba.cpython.unsafe.numbers import trailing_zeros

    njit = numba.njit
    uint64, float32 = numba.uint64, numba.float32
    block = _SPLIT_BLOCK
    groups_per_block = _BLOCK_GROUPS

    # The kernels' arguments are described by the wrappers below (threshold_split_chunk,
    # qsgd_sum), which are the only callers.
    @njit(nogil=True, boundscheck=False, cache=True)
    def split(x, below, zero, rest, idx, val, base):
        n = x.shape[0]
        found = 0
        whole = n // block
        for b in range(whole):
            s = b * block
            xb = x[s : s + block]
            rb = rest[s : s + block]
            hits = uint64(0)
            for j in range(uint64(block)):  # vectorised: the residual and a bit per hit
                v = xb[j]
                h = abs(v) > below  # false for NaN: it stays in the residual, unsent
                hits |= uint64(h) << j
                rb[j] = zero if h else v
            while hits:  # the hits only, ascending
                j = trailing_zeros(hits)
                idx[found] = base + s + j
                val[found] = xb[j]
                found += 1
                hits &= hits - uint64(1)
        for i in range(whole * block, n):
            v = x[i]
            if abs(v) > below:
                rest[i] = zero
                idx[found] = base + i
                val[found] = v
                found += 1
            else:
                rest[i] = v
        return found

    @njit(nogil=True, boundscheck=False, inline="always")
    def spread(win, raw, lim, r, g0, nb, bits, stages, words):
        """Row ``r``'s words ``g0`` to ``g0 + nb`` (the first ``lim`` read whole, the rest
        byte by byte) with their eight codes spread to one byte each, into ``words``."""
        s1, h1, l1, s2, h2, l2, s3, h3, l3 = (
            stages[0], stages[1], stages[2], stages[3], stages[4], stages[5],
            stages[6], stages[7], stages[8],
        )
        need = raw.shape[1]
        row_words = win[r, g0 : g0 + lim]
        for g in range(uint64(lim)):
            y = row_words[g]
            y = ((y << s1) & h1) | (y & l1)
            y = ((y << s2) & h2) | (y & l2)
            y = ((y << s3) & h3) | (y & l3)
            words[g] = y
        for g in range(lim, nb):  # the array's last words, assembled byte by byte
            p = (g0 + g) * bits
            y = uint64(0)
            for j in range(min(8, need - p)):
                y |= uint64(raw[r, p + j]) << uint64(8 * j)
            y = ((y << s1) & h1) | (y & l1)
            y = ((y << s2) & h2) | (y & l2)
            y = ((y << s3) & h3) | (y & l3)
            words[g] = y

    # ``contract`` lets LLVM fuse ``acc + code * step`` into one fused multiply-add, which is
    # what ATen's ``addcmul_`` computes on this CPU (callers check the bits once; see
    # gradzip.compressors.qsgd). Loops run over unsigned counts: with signed indices Numba
    # wraps negative ones around, which keeps LLVM from vectorising them.
    @njit(nogil=True, boundscheck=False, fastmath={"contract"}, cache=True)
    def qsgd(win, raw, safe, bits, stages, first, count, size, steps, offsets, divisor, out):
        rows = win.shape[0]
        width = groups_per_block * 8
        top = np.uint8(0)
        acc = np.empty(width, np.float32)
        words = np.empty(4 * groups_per_block, np.uint64)
        codes = words.view(np.uint8)
        g_first = first // 8
        g_end = (first + count + 7) // 8
        for g0 in range(g_first, g_end, groups_per_block):
            nb = min(g_end - g0, groups_per_block)
            e0 = g0 * 8
            lo = max(first, e0) - e0
            hi = min(first + count, e0 + nb * 8) - e0
            acc[lo:hi] = 0
            # Four rows at a time: their codes are spread first, then one loop adds all four
            # into each sum (in row order) while it is in a register.
            fused = rows // 4 * 4
            for r0 in range(0, fused, 4):
                for q in range(4):
                    lim = min(nb, max(0, safe[r0 + q] - g0))
                    spread(win, raw, lim, r0 + q, g0, nb, bits, stages,
                           words[q * groups_per_block : (q + 1) * groups_per_block])
                i = lo
                while i < hi:
                    b = (e0 + i - first) // size
                    stop = min(hi, first + (b + 1) * size - e0)
                    st0, st1 = steps[r0, b], steps[r0 + 1, b]
                    st2, st3 = steps[r0 + 2, b], steps[r0 + 3, b]
                    sums = acc[i:stop]
                    c0 = codes[i:stop]
                    c1 = codes[width + i : width + stop]
                    c2 = codes[2 * width + i : 2 * width + stop]
                    c3 = codes[3 * width + i : 3 * width + stop]
                    for t in range(uint64(stop - i)):
                        x0, x1, x2, x3 = c0[t], c1[t], c2[t], c3[t]
                        top = max(top, max(max(x0, x1), max(x2, x3)))
                        v = sums[t] + float32(x0) * st0
                        v = v + float32(x1) * st1
                        v = v + float32(x2) * st2
                        sums[t] = v + float32(x3) * st3
                    i = stop
            for r in range(fused, rows):
                lim = min(nb, max(0, safe[r] - g0))
                spread(win, raw, lim, r, g0, nb, bits, stages, words)
                i = lo
                while i < hi:
                    b = (e0 + i - first) // size
                    stop = min(hi, first + (b + 1) * size - e0)
                    step = steps[r, b]
                    sums = acc[i:stop]
                    part = codes[i:stop]
                    for t in range(uint64(stop - i)):
                        c = part[t]
                        top = max(top, c)
                        sums[t] = sums[t] + float32(c) * step
                    i = stop
            i = lo
            while i < hi:
                b = (e0 + i - first) // size
                stop = min(hi, first + (b + 1) * size - e0)
                off = offsets[b]
                sums = acc[i:stop]
                dest = out[e0 + i - first : e0 + stop - first]
                for t in range(uint64(stop - i)):
                    dest[t] = (sums[t] - off) / divisor
                i = stop
        return top

    return {"split": split, "qsgd": qsgd}


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
