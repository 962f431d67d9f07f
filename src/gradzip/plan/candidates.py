"""The candidates a plan weighs, each with its quality class.

Quality classes, from the least to the most change to training:

* ``lossless``: the exact average (``none``);
* ``gentle``: measured to train like ``none`` in gradzip's benchmarks (casts to 16 bits,
  PowerSGD rank 4 and 8, Top-k 10%);
* ``aggressive``: more compression and measurably slower or worse convergence (PowerSGD ranks 1
  and 2, Top-k 1%, the hard threshold, QSGD, sign);
* ``outer``: outer-step training (DiLoCo): ``H`` local steps between exchanges.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradzip._validate import check_choice, check_int
from gradzip.spec import compressor_from_spec

__all__ = ["QUALITIES", "Candidate", "default_candidates"]

#: The quality classes, from the least to the most change to training.
QUALITIES = ("lossless", "gentle", "aggressive", "outer")


@dataclass(frozen=True)
class Candidate:
    """One way to communicate.

    Attributes:
        name: a short label (``"powersgd-r4"``, ``"diloco-h30-8bit"``).
        spec: the compressor spec of every exchange (per step, or of the pseudo-gradient).
        quality: one of :data:`QUALITIES`.
        outer_steps: ``H`` for outer-step training (an exchange every ``H`` steps), else 0.

    Raises:
        TypeError, ValueError: an invalid field, naming it.
    """

    name: str
    spec: str
    quality: str
    outer_steps: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"`name` must be a non-empty str, got {self.name!r}")
        compressor_from_spec(self.spec)  # raises on a bad spec, naming it
        check_choice("quality", self.quality, QUALITIES)
        check_int("outer_steps", self.outer_steps, minimum=0)
        if (self.quality == "outer") != (self.outer_steps > 0):
            raise ValueError(f"`outer_steps` must be > 0 exactly for quality 'outer', got "
                             f"{self.outer_steps} with quality {self.quality!r}")


def default_candidates() -> tuple[Candidate, ...]:
    """The candidates ``gradzip plan`` weighs by default."""
    per_step = [
        ("none", "none", "lossless"),
        ("fp16", "fp16", "gentle"),
        ("bf16", "bf16", "gentle"),
        ("powersgd-r1", "powersgd:rank=1", "aggressive"),
        ("powersgd-r2", "powersgd:rank=2", "aggressive"),
        ("powersgd-r4", "powersgd:rank=4", "gentle"),
        ("powersgd-r8", "powersgd:rank=8", "gentle"),
        ("topk-10%", "topk:ratio=0.1", "gentle"),
        ("topk-1%", "topk:ratio=0.01", "aggressive"),
        ("threshold-1%", "threshold:budget=0.01", "aggressive"),
        ("qsgd", "qsgd", "aggressive"),
        ("sign", "sign", "aggressive"),
    ]
    out = [Candidate(n, s, q) for n, s, q in per_step]
    for h in (10, 30, 100):
        out.append(Candidate(f"diloco-h{h}", "none", "outer", h))
        out.append(Candidate(f"diloco-h{h}-8bit", "scatterq:bits=8", "outer", h))
    return tuple(out)
