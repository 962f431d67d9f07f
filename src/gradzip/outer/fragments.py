"""Streaming fragments: which tensors are synchronised together, and when.

With ``P`` fragments and ``H`` inner steps between two synchronisations of the same fragment,
fragment ``f`` is *sent* after every inner step ``s`` with ``s % H == (f + 1) * H / P % H``
(evenly offset; with one fragment, every ``H`` steps), and its result is *applied* ``delay``
steps later, while inner steps continue. ``delay < H / P`` so that a fragment's result is
applied before the next fragment is sent: at most one exchange is in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gradzip._validate import check_int

__all__ = ["FragmentPlan", "split_fragments"]


def split_fragments(names: Sequence[str], fragments: int) -> list[tuple[str, ...]]:
    """Tensors assigned to fragments in turn (strided: tensor ``i`` goes to fragment
    ``i % fragments``), so each fragment spans the depth of the model.

    Raises:
        ValueError: more fragments than tensors.
    """
    if fragments > len(names):
        raise ValueError(f"`fragments` must be at most the number of tensors ({len(names)}), got {fragments}")
    return [tuple(names[f::fragments]) for f in range(fragments)]


@dataclass(frozen=True)
class FragmentPlan:
    """The schedule of synchronisations.

    Args:
        inner_steps: ``H``, inner steps between two synchronisations of one fragment, >= 1.
        fragments: ``P``, >= 1, dividing ``H``.
        delay: ``tau``, inner steps between sending a fragment and applying its result, in
            ``[0, H / P)``.

    Raises:
        TypeError, ValueError: an invalid value, naming the parameter.
    """

    inner_steps: int
    fragments: int = 1
    delay: int = 0

    def __post_init__(self) -> None:
        h = check_int("inner_steps", self.inner_steps, minimum=1)
        p = check_int("fragments", self.fragments, minimum=1)
        if h % p:
            raise ValueError(f"`inner_steps` must be a multiple of `fragments` ({p}), got {h}")
        check_int("delay", self.delay, minimum=0, maximum=h // p - 1)

    @property
    def period(self) -> int:
        """Inner steps between two consecutive sends (of different fragments)."""
        return self.inner_steps // self.fragments

    def sent_after(self, step: int) -> int | None:
        """The fragment sent after inner step ``step`` (counted from 1), or ``None``."""
        if step < 1 or step % self.period:
            return None
        return (step // self.period - 1) % self.fragments
