"""Elementwise ops over lists of tensor pairs, one launch where the device allows it.

PowerSGD copies and subtracts once per group of same-shape matrices; a call with a dozen groups
(Accordion's two ranks split each shape in two) makes a dozen of each. PyTorch's multi-tensor
ops (``torch._foreach_*``) take a whole list in one call: one kernel launch on CUDA, and one
Python call instead of one per tensor on any device.

Why not hand every pair to them: CUDA's multi-tensor kernel takes a list only when each pair
has the same sizes and strides and each tensor is dense; otherwise ``torch._foreach_*`` falls
back to one kernel per pair, while a profiler on the CPU still sees one op (see
``benchmarks/op_counts.py``). So the pairs that qualify go in one multi-tensor call and the
others take one op each: the count of ops is what CUDA launches. The values are the plain ops'
bit for bit (an elementwise copy or difference rounds the same however it is launched).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["copy_many", "sub_many_"]


def _one_launch(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether CUDA's multi-tensor kernel takes the pair ``(a, b)`` (a sufficient test: the
    same sizes, strides and dtype, and ``a`` contiguous, hence dense)."""
    return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.is_contiguous())


def _split(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], other: str
           ) -> tuple[list[int], list[int]]:
    """The indices of the pairs that go in one multi-tensor op, and of the others."""
    if len(dsts) != len(srcs):
        raise ValueError(f"`dsts` and `{other}` must have the same length, got {len(dsts)} "
                         f"and {len(srcs)}")
    together: list[int] = []
    apart: list[int] = []
    for i, (d, s) in enumerate(zip(dsts, srcs, strict=True)):
        (together if _one_launch(d, s) else apart).append(i)
    if len(together) == 1:  # a list of one is one op either way
        apart, together = together + apart, []
    return together, apart


def _pairwise(dsts: Sequence[torch.Tensor], others: Sequence[torch.Tensor], name: str,
              many: Callable[[list[torch.Tensor], list[torch.Tensor]], object],
              one: Callable[[torch.Tensor, torch.Tensor], object]) -> None:
    """``one(dsts[i], others[i])`` for every ``i``, the pairs CUDA's multi-tensor kernel takes
    by one ``many`` call instead (``name``: the caller's parameter, for the message)."""
    together, apart = _split(dsts, others, name)
    if together:
        many([dsts[i] for i in together], [others[i] for i in together])
    for i in apart:
        one(dsts[i], others[i])


def copy_many(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``dsts[i].copy_(srcs[i])`` for every ``i``: the pairs CUDA's multi-tensor kernel takes
    in one ``torch._foreach_copy_``, the others one copy each."""
    _pairwise(dsts, srcs, "srcs", torch._foreach_copy_, torch.Tensor.copy_)


def sub_many_(dsts: Sequence[torch.Tensor], others: Sequence[torch.Tensor]) -> None:
    """``dsts[i].sub_(others[i])`` for every ``i``: the pairs CUDA's multi-tensor kernel takes
    in one ``torch._foreach_sub_``, the others one subtraction each."""
    _pairwise(dsts, others, "others", torch._foreach_sub_, torch.Tensor.sub_)
