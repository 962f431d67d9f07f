"""Chunked selection and wide bit packing: pure functions for chunked Top-k.

A flat tensor of ``n`` entries is cut into consecutive chunks of ``chunk`` entries (the last
one shorter when ``chunk`` does not divide ``n``); each chunk keeps its ``k`` largest entries
by magnitude (all of a chunk shorter than ``k``). A kept entry is named by its index *inside*
its chunk, which needs only ``ceil(log2(chunk))`` bits: the chunk it belongs to follows from
its position in the message, since every chunk sends a fixed number of entries.
"""

from __future__ import annotations

import torch

from gradzip.ops.bits import pack_bits, packed_size, unpack_bits

__all__ = [
    "ChunkLayout", "chunk_flat_indices", "chunk_layout", "chunk_topk", "pack_wide", "unpack_wide",
    "wide_size",
]


class ChunkLayout(tuple[int, int, int, int]):
    """``(full_chunks, k, last_len, last_k)``: the chunks of one tensor and what each keeps."""

    @property
    def kept(self) -> int:
        """Entries kept in the whole tensor."""
        full, k, _, last_k = self
        return full * k + last_k


def chunk_layout(numel: int, chunk: int, k: int) -> ChunkLayout:
    """How a tensor of ``numel`` entries is cut: full chunks, the entries each keeps, the
    length of a trailing partial chunk (0 if none) and the entries it keeps."""
    full, last = divmod(numel, chunk)
    return ChunkLayout((full, min(k, chunk), last, min(k, last)))


def chunk_topk(x: torch.Tensor, chunk: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``k`` largest-magnitude entries of every chunk of every row of ``x[L, n]``.

    Returns:
        ``(values, flat_indices, local_indices)``, each ``[L, kept]``: the signed entries,
        their int64 indices in the row, and their int64 indices inside their chunk, chunk by
        chunk in order (the full chunks, then the partial one).
    """
    rows, numel = x.shape
    full, kk, last, last_k = chunk_layout(numel, chunk, k)
    values, flat, local = [], [], []
    if full:
        blocks = x[:, : full * chunk].reshape(rows, full, chunk)
        idx = torch.topk(blocks.abs(), kk, dim=2, sorted=True).indices  # [L, full, kk]
        idx = idx.sort(dim=2).values  # ascending inside a chunk: ties cannot reorder a message
        values.append(torch.gather(blocks, 2, idx).reshape(rows, -1))
        base = (torch.arange(full, device=x.device) * chunk).view(1, full, 1)
        flat.append((idx + base).reshape(rows, -1))
        local.append(idx.reshape(rows, -1))
    if last_k:
        tail = x[:, full * chunk :]
        idx = torch.topk(tail.abs(), last_k, dim=1, sorted=True).indices.sort(dim=1).values
        values.append(torch.gather(tail, 1, idx))
        flat.append(idx + full * chunk)
        local.append(idx)
    return torch.cat(values, dim=1), torch.cat(flat, dim=1), torch.cat(local, dim=1)


def chunk_flat_indices(local: torch.Tensor, numel: int, chunk: int, k: int) -> torch.Tensor:
    """Inverse of the ``local`` output of :func:`chunk_topk`: row indices from chunk-local ones.

    Raises:
        ValueError: a local index lies outside its chunk (a corrupt message).
    """
    full, kk, last, last_k = chunk_layout(numel, chunk, k)
    sizes = torch.cat([
        torch.full((full * kk,), chunk, dtype=torch.int64),
        torch.full((last_k,), last, dtype=torch.int64),
    ]).to(local.device)
    starts = torch.cat([
        torch.arange(full, dtype=torch.int64).repeat_interleave(kk) * chunk,
        torch.full((last_k,), full * chunk, dtype=torch.int64),
    ]).to(local.device)
    if local.numel() and bool(((local < 0) | (local >= sizes)).any()):
        raise ValueError(f"message indices must lie inside their chunk of {chunk} entries, got "
                         f"range [{int(local.min())}, {int(local.max())}]")
    return local + starts


def wide_size(count: int, bits: int) -> int:
    """Bytes holding ``count`` codes of ``bits`` bits (1 to 16) packed by :func:`pack_wide`:
    exactly ``ceil(count * bits / 8)``."""
    if bits <= 8:
        return packed_size(count, bits)
    return count + packed_size(count, bits - 8)


def pack_wide(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack int64 codes ``[L, n]`` below ``2**bits`` (``bits`` up to 16) into uint8
    ``[L, wide_size(n, bits)]``: the low 8 bits of every code as one byte stream, then the
    remaining ``bits - 8`` bits packed densely (so 12-bit codes take 1.5 bytes each)."""
    assert 1 <= bits <= 16, bits
    if bits <= 8:
        return pack_bits(codes, bits)
    low = (codes & 0xFF).to(torch.uint8)
    high = pack_bits(codes >> 8, bits - 8)
    return torch.cat([low, high], dim=1)


def unpack_wide(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_wide`: ``count`` codes per row as int64 ``[L, count]``.

    Raises:
        ValueError: ``packed`` is shorter than the codes need (a truncated message).
    """
    assert 1 <= bits <= 16, bits
    if bits <= 8:
        return unpack_bits(packed, bits, count).to(torch.int64)
    if packed.shape[-1] < wide_size(count, bits):
        raise ValueError(f"`packed` must hold at least {wide_size(count, bits)} bytes for {count} "
                         f"codes of {bits} bits, got {packed.shape[-1]}")
    low = packed[:, :count].to(torch.int64)
    high = unpack_bits(packed[:, count:], bits - 8, count).to(torch.int64)
    return low | (high << 8)
