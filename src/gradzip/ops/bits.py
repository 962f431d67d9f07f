"""Packing small unsigned codes into bytes, and back.

Codes of ``bits`` bits are packed eight at a time: eight codes fill exactly ``bits`` bytes.
Each group of eight becomes one integer word (code ``k`` shifted by ``k * bits``), and the
word's low ``bits`` bytes are the packed bytes. Every step is a whole-tensor operation on one
of the eight code positions or byte positions at a time (rows made contiguous by a transpose),
so the cost is a few passes over the codes on any device, with no per-bit intermediate tensor.
Bytes are taken from words by shifts, never by reinterpreting memory, so the layout does not
depend on the machine's byte order.

On the CPU, faster NumPy paths give the same bytes: one-bit codes are packed by NumPy's
``packbits`` and unpacked through a 256-entry table (each packed byte to its eight codes); on
a little-endian CPU, wider codes are unpacked from a 64-bit load of each group's bytes whose
fields are spread to one byte each by three mask-and-shift stages (and packed by the reverse
stages), in chunks that stay in cache. :func:`bit_keys` combines several one-bit streams into
lookup keys without unpacking them.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import numpy as np
import torch

from gradzip._validate import check_int
from gradzip.ops.branches import cpu_form
from gradzip.ops.flat import to_device

__all__ = [
    "MAX_KEY_WORKERS", "bit_keys", "code_width", "keys_per_byte", "pack_bits", "packed_size",
    "unpack_bits",
]

# The narrowest integer type holding eight codes of ``bits`` bits (8 * bits bits). int64 for
# 5 to 7 bits: shifts into and out of the sign bit behave as on unsigned words, because every
# extracted field is masked.
_WORD = {
    1: torch.uint8, 2: torch.int16, 3: torch.int32, 4: torch.int32,
    5: torch.int64, 6: torch.int64, 7: torch.int64,
}


def code_width(max_code: int) -> int:
    """Bits needed to store codes in ``[0, max_code]`` (at least 1)."""
    assert max_code >= 0
    return max(1, int(max_code).bit_length())


def packed_size(count: int, bits: int) -> int:
    """Bytes holding ``count`` codes of ``bits`` bits each."""
    return (count * bits + 7) // 8


def pack_bits(codes: torch.Tensor, bits: int, *, checked: bool = True) -> torch.Tensor:
    """Pack codes ``[..., n]`` (values below ``2**bits``) into uint8 ``[..., packed_size(n, bits)]``.

    Bit ``j`` of code ``i`` lands at overall bit position ``i * bits + j`` (little-endian within
    each byte), so any width from 1 to 8 packs densely. The result never shares memory with
    ``codes``.

    Args:
        codes: integer (or bool) codes in ``[0, 2**bits)``.
        bits: bits per code, in [1, 8].
        checked: test the codes' range (a host sync); callers whose codes are in range by
            construction pass ``False``.

    Returns:
        The packed bytes, uint8.

    Raises:
        TypeError: ``codes`` is not an integer or bool tensor, or ``bits`` not an integer.
        ValueError: ``bits`` is outside [1, 8], or (``checked``) a code is negative or at
            least ``2**bits`` (it would spill into its neighbours' bits).
    """
    bits = check_int("bits", bits, minimum=1, maximum=8)
    if checked:
        _check_codes(codes, bits)
    *lead, n = codes.shape
    if bits == 8:  # a copy: ops never hand back (or alias) their input
        return codes.to(torch.uint8, memory_format=torch.contiguous_format, copy=True)
    codes = codes.to(torch.uint8)
    if bits == 1 and cpu_form(codes.device):
        # NumPy's packbits with little-endian bit order is exactly this layout for 0/1 codes.
        return torch.from_numpy(np.packbits(codes.numpy(), axis=-1, bitorder="little"))
    if _NUMPY_PATH and cpu_form(codes.device) and n > 0:
        packed = _pack_fields(codes.reshape(-1, n).numpy(), bits)
        return torch.from_numpy(packed).reshape(*lead, packed.shape[1])
    groups = -(-n // 8)
    if groups * 8 != n:
        codes = torch.nn.functional.pad(codes, (0, groups * 8 - n))
    # Every group of 8 codes as one word: each code shifted to its field, the fields summed
    # (disjoint bits: the sum is their OR), a few whole-tensor ops whatever the width (one
    # launch each on a GPU, where a loop over the 8 positions would take 16).
    word = _WORD[bits]
    fields = codes.reshape(*lead, groups, 8).to(word) << _shifts(8, bits, word, codes.device)
    acc = fields.sum(-1, dtype=word)  # [..., groups]
    if bits == 1:
        packed = acc.unsqueeze(-1)  # the word is the byte
    else:
        packed = ((acc.unsqueeze(-1) >> _shifts(bits, 8, word, codes.device)) & 0xFF).to(torch.uint8)
    return packed.reshape(*lead, groups * bits)[..., : packed_size(n, bits)].contiguous()


@functools.lru_cache(maxsize=64)
def _shifts_on(count: int, step: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return to_device((torch.arange(count, dtype=torch.int64) * step).to(dtype), device)


def _shifts(count: int, step: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[0, step, 2 step, ...]`` (``count`` of them) in ``dtype`` on ``device``, cached (a
    shift by a tensor of the word's type keeps the word's type)."""
    return _shifts_on(count, step, dtype, str(device))


def _check_codes(codes: torch.Tensor, bits: int) -> None:
    if not isinstance(codes, torch.Tensor) or codes.dtype.is_floating_point or codes.is_complex():
        got = codes.dtype if isinstance(codes, torch.Tensor) else type(codes).__name__
        raise TypeError(f"`codes` must be an integer or bool tensor, got {got}")
    if codes.numel() == 0 or codes.dtype == torch.bool:
        return
    lo, hi = int(codes.min()), int(codes.max())
    if lo < 0 or hi >= 1 << bits:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"`codes` must lie in [0, {(1 << bits) - 1}] for bits={bits}, got {bad}"
        )


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``count`` codes of ``bits`` bits as uint8 ``[..., count]``.

    Raises:
        ValueError: ``packed`` is shorter than ``count`` codes need (a truncated message).
    """
    assert 1 <= bits <= 8, bits
    need = packed_size(count, bits)
    if packed.shape[-1] < need:
        raise ValueError(
            f"`packed` must hold at least {need} bytes for {count} codes of {bits} bits, "
            f"got {packed.shape[-1]}"
        )
    *lead, _ = packed.shape
    if bits == 8:  # the codes are the bytes: a copy, never the caller's tensor (or a view of it)
        return packed[..., :need].to(torch.uint8, memory_format=torch.contiguous_format,
                                     copy=True)
    packed = packed[..., :need].to(torch.uint8)
    if _NUMPY_PATH and cpu_form(packed.device) and count > 0:
        flat = packed.reshape(-1, need).numpy()
        codes_np = _unpack_ones(flat, count) if bits == 1 else _unpack_fields(flat, bits, count)
        # Contiguous (a copy of the codes, when count is not a multiple of 8): strided rows
        # make every later elementwise pass over them several times slower.
        return torch.from_numpy(np.ascontiguousarray(codes_np)).reshape(*lead, count)
    groups = -(-count // 8)
    if groups * bits != need:
        packed = torch.nn.functional.pad(packed, (0, groups * bits - need))
    word = _WORD[bits]
    # Each group's bytes as one word (shifted and summed, as in pack_bits), then every code
    # cut out of it at once.
    if bits == 1:
        acc = packed.reshape(*lead, groups)  # the byte is the word
    else:
        by_byte = packed.reshape(*lead, groups, bits).to(word)
        acc = (by_byte << _shifts(bits, 8, word, packed.device)).sum(-1, dtype=word)
    mask = (1 << bits) - 1
    codes = ((acc.unsqueeze(-1) >> _shifts(8, bits, word, packed.device)) & mask).to(torch.uint8)
    return codes.reshape(*lead, groups * 8)[..., :count]


# The NumPy paths read memory as little-endian words; elsewhere the torch path above is used.
_NUMPY_PATH = sys.byteorder == "little"
# Words (8 codes each) handled per step of the field-spreading loop: 256 KiB, cache-resident.
_SPREAD_CHUNK = 1 << 15


def _bit_table() -> np.ndarray:
    """uint64 [256]: the eight bytes of entry ``v`` (in memory order) are the bits of ``v``,
    lowest first."""
    table = (np.arange(256, dtype=np.uint16)[:, None] >> np.arange(8, dtype=np.uint16)) & 1
    return np.ascontiguousarray(table.astype(np.uint8)).view(np.uint64).reshape(256)


_BIT_TABLE = _bit_table() if _NUMPY_PATH else None


def _unpack_ones(packed: np.ndarray, count: int) -> np.ndarray:
    """One-bit codes of ``packed[rows, bytes]`` as uint8 ``[rows, count]``: one table lookup per
    packed byte gives its eight codes."""
    words = np.take(_BIT_TABLE, packed, mode="clip")  # [rows, bytes] uint64
    return words.view(np.uint8)[:, :count]


def _unpack_fields(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Codes of 2 to 7 bits of ``packed[rows, need]`` as uint8 ``[rows, count]``.

    Group ``g`` (eight codes) is the ``bits`` bytes from byte ``g * bits``; read as one
    little-endian 64-bit word (its upper bytes belong to the next group and are masked off),
    code ``k`` sits at bit ``k * bits``. Three stages move the fields apart, halving their
    number per lane each time: four codes to each 32-bit half, two to each 16-bit quarter,
    one to each byte. The word's bytes are then the eight codes in order.
    """
    rows, need = packed.shape
    groups = -(-count // 8)
    # Room for the last group's 8-byte read: every row padded with zeros.
    stride = groups * bits + 8
    buf = np.zeros((rows, stride), dtype=np.uint8)
    buf[:, :need] = packed
    windows = np.ndarray(
        (rows, groups), dtype=np.uint64, buffer=buf, strides=(stride, bits)
    )  # unaligned: read once per chunk, by the copy below
    # Stage (shift, high, low): the upper field of each lane moves up by ``shift`` to the
    # start of the lane's upper half (``high`` keeps it, and drops what the shift carried in
    # from below or from the next group's bytes); ``low`` keeps the lower field in place.
    quad, pair, one = _lane_masks(bits)
    stages = [
        (np.uint64(32 - 4 * bits), np.uint64(quad << 32), np.uint64(quad)),
        (np.uint64(16 - 2 * bits), np.uint64(pair << 16), np.uint64(pair)),
        (np.uint64(8 - bits), np.uint64(one << 8), np.uint64(one)),
    ]
    out = np.empty((rows, groups), dtype=np.uint64)
    _run_stages(out, stages, np.left_shift, source=windows)
    return out.view(np.uint8)[:, :count]


def _lane_masks(bits: int) -> tuple[int, int, int]:
    """The stages' field masks, one field at the bottom of each lane: ``quad`` four codes
    wide in the low 32-bit half, ``pair`` two codes wide in each 32-bit half, ``one`` one
    code wide in each 16-bit quarter."""
    quad = (1 << (4 * bits)) - 1
    pair = ((1 << (2 * bits)) - 1) * (1 | 1 << 32)
    one = ((1 << bits) - 1) * (1 | 1 << 16 | 1 << 32 | 1 << 48)
    return quad, pair, one


def _run_stages(
    y_all: np.ndarray, stages: list[tuple[Any, Any, Any]], shift_op: Any,
    source: np.ndarray | None = None,
) -> None:
    """Apply ``stages`` to the words of ``y_all`` in place, chunk by chunk (in cache):
    per stage, ``y = (y & low) | (shift_op(y, shift) & high)``. With ``source``, each chunk
    is first copied from it (an unaligned view, read once)."""
    rows, groups = y_all.shape
    step = max(1, _SPREAD_CHUNK // rows)
    # One column at a time where there are more rows than a chunk holds: room for all rows.
    scratch = np.empty(max(_SPREAD_CHUNK, rows * step), dtype=np.uint64)
    for start in range(0, groups, step):
        y = y_all[:, start : start + step]
        if source is not None:
            np.copyto(y, source[:, start : start + step])
        moved = scratch[: y.size].reshape(y.shape)
        for shift, high, low in stages:
            shift_op(y, shift, out=moved)
            moved &= high
            y &= low
            y |= moved


#: Most workers whose one-bit streams :func:`bit_keys` combines (a key is one byte).
MAX_KEY_WORKERS = 8


def keys_per_byte(workers: int) -> int:
    """Entries of every worker that one key of :func:`bit_keys` covers: the largest power of two
    with ``entries * workers <= 8``."""
    assert 1 <= workers <= MAX_KEY_WORKERS, workers
    entries = 8
    while entries * workers > 8:
        entries //= 2
    return entries


@functools.cache
def _key_tables(workers: int) -> tuple[np.ndarray, ...]:
    """Per worker ``w``: a 256-entry table from a packed byte (eight one-bit entries) to its
    ``8 / e`` keys' contributions (bit ``j * workers + w`` of key ``i`` is entry ``i * e + j``),
    as one unsigned word per byte whose memory bytes are the keys in order."""
    e = keys_per_byte(workers)
    per_byte = 8 // e
    value = np.arange(256, dtype=np.uint16)
    tables = []
    for w in range(workers):
        keys = np.zeros((256, per_byte), dtype=np.uint8)
        for i in range(per_byte):
            for j in range(e):
                keys[:, i] |= (((value >> (i * e + j)) & 1) << (j * workers + w)).astype(np.uint8)
        tables.append(np.ascontiguousarray(keys).view(f"u{per_byte}").reshape(256))
    return tuple(tables)


def bit_keys(packed: np.ndarray) -> np.ndarray:
    """Interleave the one-bit streams of ``packed[W, B]`` (uint8, ``W <= 8`` rows, bit ``i % 8``
    of byte ``i // 8`` is entry ``i``) into byte keys, without unpacking them.

    Key ``q`` covers entries ``q * e`` to ``q * e + e - 1`` of every row, with
    ``e = keys_per_byte(W)``: bit ``j * W + w`` is entry ``q * e + j`` of row ``w``. A table
    per row turns each packed byte into its keys' bits, so the cost is one lookup per packed
    byte and row and one OR, whatever ``W``. Byte-order independent: tables and result are
    read back through the same memory layout.

    Returns:
        uint8 ``[B * 8 / e]``.
    """
    workers = packed.shape[0]
    tables = _key_tables(workers)
    acc = np.take(tables[0], packed[0], mode="clip")
    for w in range(1, workers):
        acc |= np.take(tables[w], packed[w], mode="clip")
    return acc.view(np.uint8)


def _pack_fields(codes: np.ndarray, bits: int) -> np.ndarray:
    """:func:`pack_bits` of codes ``[rows, n]`` (uint8, 2 to 7 bits) on a little-endian CPU.

    The inverse of :func:`_unpack_fields`: each group's eight code bytes, read as one 64-bit
    word, are drawn together in three stages (two codes per 16-bit lane, four per 32-bit half,
    eight in the low ``bits`` bytes), whose low ``bits`` bytes are the group's packed bytes.
    """
    rows, n = codes.shape
    groups = -(-n // 8)
    words = np.zeros((rows, groups * 8), dtype=np.uint8)
    words[:, :n] = codes
    y_all = words.view(np.uint64)  # [rows, groups]
    quad, pair, one = _lane_masks(bits)
    # Stage (shift, high, low): the field at the start of each lane's upper half moves down by
    # ``shift`` to sit just above the lower field (``high`` keeps it there).
    stages = [
        (np.uint64(8 - bits), np.uint64(one << bits), np.uint64(one)),
        (np.uint64(16 - 2 * bits), np.uint64(pair << (2 * bits)), np.uint64(pair)),
        (np.uint64(32 - 4 * bits), np.uint64(quad << (4 * bits)), np.uint64(quad)),
    ]
    _run_stages(y_all, stages, np.right_shift)
    packed = words.reshape(rows, groups, 8)[:, :, :bits].reshape(rows, groups * bits)
    return np.ascontiguousarray(packed[:, : packed_size(n, bits)])
