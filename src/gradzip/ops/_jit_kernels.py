"""The compiled kernels of :mod:`gradzip.ops.jit` (Numba), imported by it at their first use.

They are module-level functions, and everything they use from outside is a module global, so
Numba's disk cache (``cache=True``) finds them again in a later process. Numba keys a cached
function by the contents of its closure too, and a closure holding another compiled function
(a dispatcher, which pickles with an identifier drawn per process) never matches: each
process would compile again and add one more entry to the cache.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.cpython.unsafe.numbers import trailing_zeros

__all__ = ["BLOCK_GROUPS", "SPLIT_BLOCK", "qsgd", "split"]

#: Entries of one block of QSGD's kernel: 8192 (32 KiB of sums) stay in the L1/L2 cache while
#: every worker's codes are added into them.
BLOCK_GROUPS = 1024
#: Entries of the threshold kernel's inner block: one vectorised loop writes the residual and
#: a 64-bit mask of the hits, whose set bits are then visited in order.
SPLIT_BLOCK = 64

njit = numba.njit
uint64, float32 = numba.uint64, numba.float32


# The kernels' arguments are described by the wrappers in gradzip.ops.jit (threshold_split_chunk,
# qsgd_sum), which are the only callers.
@njit(nogil=True, boundscheck=False, cache=True)
def split(x, below, zero, rest, idx, val, base):
    n = x.shape[0]
    found = 0
    whole = n // SPLIT_BLOCK
    for b in range(whole):
        s = b * SPLIT_BLOCK
        xb = x[s : s + SPLIT_BLOCK]
        rb = rest[s : s + SPLIT_BLOCK]
        hits = uint64(0)
        for j in range(uint64(SPLIT_BLOCK)):  # vectorised: the residual and a bit per hit
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
    for i in range(whole * SPLIT_BLOCK, n):
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
    width = BLOCK_GROUPS * 8
    top = np.uint8(0)
    acc = np.empty(width, np.float32)
    words = np.empty(4 * BLOCK_GROUPS, np.uint64)
    codes = words.view(np.uint8)
    g_first = first // 8
    g_end = (first + count + 7) // 8
    for g0 in range(g_first, g_end, BLOCK_GROUPS):
        nb = min(g_end - g0, BLOCK_GROUPS)
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
                       words[q * BLOCK_GROUPS : (q + 1) * BLOCK_GROUPS])
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
