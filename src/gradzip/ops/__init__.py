"""Pure tensor math: selection, bit packing, low rank, flat buffers, seeded generators.

Nothing here holds state or talks to other processes, and randomness only ever comes from an
explicit key: a seeded :class:`torch.Generator`, or an integer hash of the key and each entry's
position (QSGD's noise, Rand-k's draws), which gives the same bits on every device.
"""

from gradzip.ops.bits import code_width, pack_bits, packed_size, unpack_bits
from gradzip.ops.flat import flatten_workers, split_flat
from gradzip.ops.lowrank import orthogonalize
from gradzip.ops.random import generator_for, stable_hash
from gradzip.ops.select import (
    index_dtype,
    randk_indices,
    threshold_select,
    topk_abs,
)

__all__ = [
    "code_width",
    "flatten_workers",
    "generator_for",
    "index_dtype",
    "orthogonalize",
    "pack_bits",
    "packed_size",
    "randk_indices",
    "split_flat",
    "stable_hash",
    "threshold_select",
    "topk_abs",
    "unpack_bits",
]
