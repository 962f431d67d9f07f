"""Seeded generators derived from stable keys.

A generator is rebuilt from ``(seed, step, tensor name, ...)`` whenever randomness is needed, so
no generator state has to be saved: resuming at step ``k`` draws exactly what the uninterrupted
run drew. Python's ``hash`` is salted per process, so keys are hashed with BLAKE2 instead; every
rank derives the same seed from the same key.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["generator_for", "stable_hash"]


def stable_hash(*keys: object) -> int:
    """Return a 63-bit integer that depends only on ``repr`` of the keys."""
    digest = hashlib.blake2b(repr(keys).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def generator_for(*keys: object, device: torch.device | str = "cpu") -> torch.Generator:
    """Return a :class:`torch.Generator` on ``device`` seeded from ``keys``.

    Args:
        *keys: any values with a stable ``repr`` (ints, strings, tuples).
        device: where the generator draws.

    Returns:
        A fresh generator; equal keys give equal streams on every process.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(stable_hash(*keys))
    return gen
