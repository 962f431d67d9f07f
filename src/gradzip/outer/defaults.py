"""The outer optimizer's default settings, and for Nesterov their dependence on ``H``."""

from __future__ import annotations

from gradzip._validate import check_choice, check_int

__all__ = ["KIND_DEFAULTS", "OUTER_KINDS", "outer_defaults"]

#: ``nesterov``: SGD with Nesterov momentum (DiLoCo); ``sgd``: SGD, momentum optional (0 by
#: default); ``ef-momentum``: no outer momentum, error feedback's residual decayed instead
#: (SparseLoCo).
OUTER_KINDS = ("nesterov", "sgd", "ef-momentum")

#: kind -> (lr, momentum, residual decay) when ``H`` is not known: the published settings.
KIND_DEFAULTS = {
    "nesterov": (0.7, 0.9, 1.0),
    "sgd": (1.0, 0.0, 1.0),
    "ef-momentum": (1.0, 0.0, 0.95),
}


def outer_defaults(inner_steps: int, kind: str = "nesterov") -> tuple[float, float]:
    """The default outer ``(lr, momentum)`` at ``H = inner_steps``.

    Raises:
        TypeError: ``inner_steps`` is not an int.
        ValueError: ``inner_steps`` < 1, or an unknown ``kind``.
    """
    h = check_int("inner_steps", inner_steps, minimum=1)
    kind = check_choice("kind", kind, OUTER_KINDS)
    lr, momentum, _ = KIND_DEFAULTS[kind]
    del h
    return lr, momentum
