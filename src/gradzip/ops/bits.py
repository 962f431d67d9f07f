"""Packing small unsigned codes into bytes, and back."""

from __future__ import annotations

import torch

__all__ = ["code_width", "pack_bits", "packed_size", "unpack_bits"]


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
    shifts = torch.arange(bits, device=codes.device, dtype=torch.uint8)
    planes = (codes.to(torch.uint8).unsqueeze(-1) >> shifts) & 1  # [..., n, bits]
    flat = planes.reshape(*lead, n * bits)
    pad = (-flat.shape[-1]) % 8
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    weights = (1 << torch.arange(8, device=codes.device, dtype=torch.int32)).to(torch.uint8)
    grouped = flat.reshape(*lead, -1, 8)
    return (grouped * weights).sum(dim=-1, dtype=torch.int32).to(torch.uint8)


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
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    planes = (packed[..., :need].unsqueeze(-1) >> shifts) & 1  # [..., need, 8]
    planes = planes.reshape(*lead, need * 8)[..., : count * bits].reshape(*lead, count, bits)
    weights = (1 << torch.arange(bits, device=packed.device, dtype=torch.int32)).to(torch.uint8)
    return (planes * weights).sum(dim=-1, dtype=torch.int32).to(torch.uint8)
