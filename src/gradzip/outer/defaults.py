"""The outer optimizer's default settings, and for Nesterov their dependence on ``H``.

DiLoCo's published outer step (Nesterov, lr 0.7, momentum 0.9) was tuned at H = 500 inner
steps per synchronisation, over many outer steps. At H = 10 to 100 over a few dozen outer
steps, the same learning rate with momentum 0.5 trained better on both tasks measured, at
every H, while momentum 0.9 needed a learning rate that changed with H. The ``nesterov``
default therefore takes its momentum from ``H``: 0.5 up to H = 100 (measured with
``benchmarks/outer_sweep.py``; the outer-step training page of the documentation gives the
measurement), DiLoCo's 0.9 from H = 500, linear in ``log H`` between; the learning rate is
0.7 throughout. Explicit values always win over the rule.
"""

from __future__ import annotations

import math

from gradzip._validate import check_choice, check_int

__all__ = ["KIND_DEFAULTS", "NESTEROV_BY_H", "OUTER_KINDS", "outer_defaults"]

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

#: The Nesterov rule's anchors, ``(H, outer lr, outer momentum)``, increasing in ``H``:
#: measured at 10 and 100 (per H, the smallest outer lr within 5% of the best on both tasks,
#: the same at 30), DiLoCo's published setting at 500.
NESTEROV_BY_H: tuple[tuple[int, float, float], ...] = ((10, 0.7, 0.5), (100, 0.7, 0.5),
                                                      (500, 0.7, 0.9))


def _nesterov(h: int) -> tuple[float, float]:
    """The anchors joined linearly in ``log H``, constant outside them (rounded to 1e-3)."""
    anchors = NESTEROV_BY_H
    if h <= anchors[0][0]:
        return anchors[0][1], anchors[0][2]
    for (h0, lr0, m0), (h1, lr1, m1) in zip(anchors, anchors[1:], strict=False):
        if h <= h1:
            t = (math.log(h) - math.log(h0)) / (math.log(h1) - math.log(h0))
            return round(lr0 + t * (lr1 - lr0), 3), round(m0 + t * (m1 - m0), 3)
    return anchors[-1][1], anchors[-1][2]


def outer_defaults(inner_steps: int, kind: str = "nesterov") -> tuple[float, float]:
    """The default outer ``(lr, momentum)`` at ``H = inner_steps``.

    For ``nesterov``: lr 0.7 at every ``H``; momentum 0.5 up to H = 100, rising linearly in
    ``log H`` to 0.9 at H = 500 (DiLoCo's setting) and beyond; :class:`~gradzip.Outer`
    and ``gradzip train --outer-steps`` use it for every value not given, and ``gradzip plan``
    for its outer-step candidates. ``sgd`` and ``ef-momentum`` keep lr 1.0 without momentum
    at every ``H``.

    Args:
        inner_steps: ``H``, inner steps between two synchronisations, >= 1.
        kind: the outer optimizer, one of :data:`OUTER_KINDS`.

    Returns:
        ``(lr, momentum)``.

    Raises:
        TypeError: ``inner_steps`` is not an int.
        ValueError: ``inner_steps`` < 1, or an unknown ``kind``.
    """
    h = check_int("inner_steps", inner_steps, minimum=1)
    kind = check_choice("kind", kind, OUTER_KINDS)
    if kind == "nesterov":
        return _nesterov(h)
    lr, momentum, _ = KIND_DEFAULTS[kind]
    return lr, momentum
