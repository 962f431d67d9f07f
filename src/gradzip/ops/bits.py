"""Packing small unsigned codes into bytes, and back.

Codes of ``bits`` bits are packed eight at a time: eight codes fill exactly ``bits`` bytes.
Each group of eight becomes one integer word (code ``k`` shifted by ``k * bits``), and the
word's low ``bits`` bytes are the packed bytes. Every step is a whole-tensor operation on one
of the eight code positions or byte positions at a time (rows made contiguous by a transpose),
so the cost is a few passes over the codes on any device, with no per-bit intermediate tensor.
Bytes are taken from words by shifts, never by reinterpreting memory, so the layout does not
depend on the machine's byte order.
"""

from __future__ import annotations

import torch

__all__ = ["code_width", "pack_bits", "packed_size", "unpack_bits"]

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


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes ``[..., n]`` (values below ``2**bits``) into uint8 ``[..., packed_size(n, bits)]``.

    Bit ``j`` of code ``i`` lands at overall bit position ``i * bits + j`` (little-endian within
    each byte), so any width from 1 to 8 packs densely.
    """
    assert 1 <= bits <= 8, bits
    *lead, n = codes.shape
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes.contiguous()
    groups = -(-n // 8)
    if groups * 8 != n:
        codes = torch.nn.functional.pad(codes, (0, groups * 8 - n))
    # [..., 8, groups]: position k of every group in one contiguous row.
    rows = codes.reshape(*lead, groups, 8).transpose(-1, -2).contiguous()
    word = _WORD[bits]
    acc = rows[..., 0, :].to(word)
    for k in range(1, 8):
        acc |= rows[..., k, :].to(word) << (k * bits)
    if bits == 1:
        packed = acc.unsqueeze(-1)  # the word is the byte
    else:
        packed = torch.empty(*lead, groups, bits, dtype=torch.uint8, device=codes.device)
        for j in range(bits):
            packed[..., j] = ((acc >> (8 * j)) & 0xFF).to(torch.uint8)
    return packed.reshape(*lead, groups * bits)[..., : packed_size(n, bits)].contiguous()


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
    packed = packed[..., :need].to(torch.uint8)
    if bits == 8:
        return packed.contiguous()
    groups = -(-count // 8)
    if groups * bits != need:
        packed = torch.nn.functional.pad(packed, (0, groups * bits - need))
    word = _WORD[bits]
    # [..., bits, groups]: byte j of every group in one contiguous row.
    rows = packed.reshape(*lead, groups, bits).transpose(-1, -2).contiguous()
    acc = rows[..., 0, :].to(word)
    for j in range(1, bits):
        acc |= rows[..., j, :].to(word) << (8 * j)
    mask = (1 << bits) - 1
    codes = torch.empty(*lead, 8, groups, dtype=torch.uint8, device=packed.device)
    for k in range(8):
        codes[..., k, :] = ((acc >> (k * bits)) & mask).to(torch.uint8)
    return codes.transpose(-1, -2).reshape(*lead, groups * 8)[..., :count]
