"""What a step of outer-step training is worth at each ``H``, against ``H = 10``.

The cost model prices time per step. Synchronising less often also makes each inner step
worth less: measured on two small tasks with the default outer settings
(``benchmarks/outer_step_cost.py``, BENCHMARKS section 5), ``H = 10`` reaches in ``600 / c``
inner steps what ``H`` reaches in 600, with ``c`` (the **step cost**, means over 3 seeds):

===== ============================ ============================== =========
H     character LM (transformer)   digits CNN (cross-entropy)     used here
===== ============================ ============================== =========
30    1.06 (1.01-1.14)             1.23 (1.00-1.63)               1.15
100   1.18 (1.12-1.26)             1.49 (1.26-1.62)               1.34
===== ============================ ============================== =========

:func:`outer_step_cost` interpolates the last column linearly in ``log H`` (1 at ``H = 10``
and below, where nothing was measured against it; the last segment's slope above 100), and
:func:`~gradzip.plan.outer_switch` weighs candidates by time per step times this cost, so a
larger ``H`` must save more time than it loses in progress. Pricing time alone took
``--auto-outer-follow`` from ``H = 10`` to 30 on a link where ``H = 30`` needed 22-42% more
steps to the target and lost time (BENCHMARKS section 7).
"""

from __future__ import annotations

import math

from gradzip._validate import check_int

__all__ = ["STEP_COSTS", "outer_step_cost"]

#: ``H -> step cost`` against ``H = 10``: the mean of the two tasks' means (see the module).
STEP_COSTS: dict[int, float] = {10: 1.0, 30: 1.15, 100: 1.34}


def outer_step_cost(h: int) -> float:
    """The step cost of synchronising every ``h`` inner steps, against ``h = 10`` (>= 1).

    Args:
        h: inner steps between synchronisations (>= 1).

    Returns:
        :data:`STEP_COSTS` interpolated linearly in ``log h``; 1.0 for ``h <= 10``; beyond the
        last measured ``H``, the last segment's slope continued.

    Raises:
        TypeError, ValueError: ``h`` is not an integer >= 1.
    """
    check_int("h", h, minimum=1)
    points = sorted(STEP_COSTS.items())
    if h <= points[0][0]:
        return points[0][1]
    for (h0, c0), (h1, c1) in zip(points, points[1:], strict=False):
        if h <= h1 or (h1, c1) == points[-1]:
            at = (math.log(h) - math.log(h0)) / (math.log(h1) - math.log(h0))
            return c0 + at * (c1 - c0)
    raise AssertionError("unreachable")  # pragma: no cover
