"""Outer optimizers: how the averaged pseudo-gradient moves the synchronised parameters.

Each is a frozen configuration plus a pure update over explicit state (``name -> tensor``),
so the state checkpoints as it is and can live on the CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from gradzip._validate import check_choice, check_real
from gradzip.outer.defaults import KIND_DEFAULTS, OUTER_KINDS, outer_defaults

__all__ = ["OUTER_KINDS", "OuterOptimizer"]


@dataclass(frozen=True)
class OuterOptimizer:
    """The outer step: ``anchor <- anchor - lr * direction(update)`` per tensor, where
    ``update`` is the averaged pseudo-gradient.

    ``direction`` is ``torch.optim.SGD``'s (dampening 0): with momentum ``m`` a buffer
    ``b <- m * b + update`` (``b = update`` on the first step), and the direction is
    ``update + m * b`` with Nesterov, ``b`` without; without momentum, ``update`` itself.

    Args:
        kind: one of :data:`OUTER_KINDS`.
        lr: outer learning rate, > 0 (default 0.7 for ``nesterov``, 1.0 otherwise; built
            through :meth:`build` with ``inner_steps``, as :class:`~gradzip.Outer` does, the
            ``nesterov`` default depends on ``H``: see
            :func:`~gradzip.outer_defaults`).
        momentum: in [0, 1) (default 0.9 for ``nesterov``, 0 otherwise, the same way; must be
            > 0 for ``nesterov`` and 0 for ``ef-momentum``).
        decay: factor applied to error feedback's residual before each exchange, in (0, 1]
            (default 0.95 for ``ef-momentum``; only that kind may set it below 1).

    Raises:
        TypeError, ValueError: an invalid value, naming the parameter.

    References:
        Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
        Models", 2023; Sarfi et al., "SparseLoCo", 2025.
    """

    kind: str = "nesterov"
    lr: float | None = None
    momentum: float | None = None
    decay: float | None = None

    def __post_init__(self) -> None:
        kind = check_choice("kind", self.kind, OUTER_KINDS)
        lr, momentum, decay = KIND_DEFAULTS[kind]
        lr = lr if self.lr is None else check_real("lr", self.lr, low=0, low_open=True)
        if self.momentum is not None:
            momentum = check_real("momentum", self.momentum, low=0, high=1, high_open=True)
        if self.decay is not None:
            decay = check_real("decay", self.decay, low=0, high=1, low_open=True)
        if kind == "nesterov" and momentum == 0:
            raise ValueError(f"`momentum` must be in (0, 1) for the nesterov outer optimizer, got {momentum}")
        if kind == "ef-momentum" and momentum != 0:
            raise ValueError(f"`momentum` must be 0 for the ef-momentum outer optimizer, got {momentum}")
        if kind != "ef-momentum" and decay != 1.0:
            raise ValueError(f"`decay` must be 1.0 unless the outer optimizer is ef-momentum, got {decay}")
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "lr", lr)
        object.__setattr__(self, "momentum", momentum)
        object.__setattr__(self, "decay", decay)

    @classmethod
    def build(cls, spec: OuterOptimizer | str, *, inner_steps: int | None = None,
              **overrides: float | None) -> OuterOptimizer:
        """An optimizer from an instance or a kind name, with ``lr``/``momentum``/``decay``
        replaced where given (not ``None``).

        Args:
            spec: an instance (its values are kept, bar the overrides) or a kind name.
            inner_steps: ``H``; with a kind name, the ``lr`` and ``momentum`` not given come
                from :func:`~gradzip.outer_defaults` at this ``H`` (without
                it, the kind's fixed defaults).
            **overrides: ``lr``, ``momentum``, ``decay``; ``None`` means not given.

        Raises:
            TypeError: ``spec`` is neither; ``inner_steps`` not an int.
            ValueError: ``inner_steps`` < 1, or an override out of range.
        """
        given = {k: v for k, v in overrides.items() if v is not None}
        if inner_steps is not None and isinstance(spec, str):
            kind = check_choice("kind", spec, OUTER_KINDS)
            lr, momentum = outer_defaults(inner_steps, kind)
            given = {"lr": lr, "momentum": momentum, **given}
        if isinstance(spec, OuterOptimizer):
            if not given:
                return spec
            fields = {"kind": spec.kind, "lr": spec.lr, "momentum": spec.momentum, "decay": spec.decay}
            return cls(**{**fields, **given})  # type: ignore[arg-type]
        if isinstance(spec, str):
            return cls(spec, **given)  # type: ignore[arg-type]
        raise TypeError(
            f"`outer_optimizer` must be an OuterOptimizer or one of {OUTER_KINDS}, got {type(spec).__name__}"
        )

    def describe(self) -> str:
        """A one-line description (also what ranks compare in the configuration check)."""
        return f"{self.kind}(lr={self.lr},momentum={self.momentum},decay={self.decay})"

    def apply(
        self, name: str, anchor: torch.Tensor, update: torch.Tensor, state: dict[str, Any]
    ) -> torch.Tensor:
        """The new synchronised value of tensor ``name`` (a new tensor; ``anchor`` and
        ``update`` are not modified). Replaces ``state[name]`` (the momentum buffer) where
        there is momentum, never writing into an existing buffer."""
        update = update.to(device=anchor.device, dtype=anchor.dtype)
        direction = update
        if self.momentum:
            old = state.get(name)
            buf = update.clone() if old is None else old.mul(self.momentum).add_(update)
            state[name] = buf
            direction = update.add(buf, alpha=self.momentum) if self.kind == "nesterov" else buf
        return anchor.add(direction, alpha=-float(self.lr))  # type: ignore[arg-type]

    @staticmethod
    def state_to(state: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
        """A copy of ``state`` with every buffer on ``device``."""
        return {n: t.to(device, copy=True) for n, t in state.items()}
