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
from gradzip.outer.optim import OuterOptimizer
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
        outer_lr, outer_momentum: the Nesterov outer optimizer's settings of an outer-step
            candidate; left ``None``, they are filled from ``H`` by
            :func:`~gradzip.outer_defaults` (what :class:`~gradzip.Outer`
            uses when given neither). ``None`` for a per-step candidate.

    Raises:
        TypeError, ValueError: an invalid field, naming it.
    """

    name: str
    spec: str
    quality: str
    outer_steps: int = 0
    outer_lr: float | None = None
    outer_momentum: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"`name` must be a non-empty str, got {self.name!r}")
        compressor_from_spec(self.spec)  # raises on a bad spec, naming it
        check_choice("quality", self.quality, QUALITIES)
        check_int("outer_steps", self.outer_steps, minimum=0)
        if (self.quality == "outer") != (self.outer_steps > 0):
            raise ValueError(f"`outer_steps` must be > 0 exactly for quality 'outer', got "
                             f"{self.outer_steps} with quality {self.quality!r}")
        if not self.outer_steps:
            for field in ("outer_lr", "outer_momentum"):
                if getattr(self, field) is not None:
                    raise ValueError(f"`{field}` must be None for a per-step candidate, got "
                                     f"{getattr(self, field)!r}")
            return
        # The same resolution as Outer's: each value not given comes from the H rule.
        try:
            built = OuterOptimizer.build("nesterov", inner_steps=self.outer_steps,
                                         lr=self.outer_lr, momentum=self.outer_momentum)
        except (TypeError, ValueError) as err:
            text = str(err).replace("`lr`", "`outer_lr`").replace("`momentum`", "`outer_momentum`")
            raise type(err)(text) from None
        object.__setattr__(self, "outer_lr", built.lr)
        object.__setattr__(self, "outer_momentum", built.momentum)

    def describe_outer(self) -> str:
        """``"H=30, outer lr 0.7, momentum 0.5"`` for an outer-step candidate, else ``""``."""
        if not self.outer_steps:
            return ""
        return (f"H={self.outer_steps}, outer lr {self.outer_lr:g}, "
                f"momentum {self.outer_momentum:g}")


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
