"""Which of two compression levels is the gentler one: a warning when a controller's gentle
level looks more aggressive than its aggressive one (QSGD's `levels` field is a knob here,
like `ratio` or `matrix_rank`)."""

from __future__ import annotations

import logging
import math

from gradzip.compressors.base import Compressor
from gradzip.compressors.none import NoCompression

__all__ = ["check_level_order", "gentleness"]

log = logging.getLogger(__name__)


def gentleness(compressor: Compressor) -> tuple[str, float] | None:
    """How much a compressor keeps: ``(knob, value)`` where, for one knob, a higher value is
    gentler. ``None`` where the compressor has no such knob.
    """
    if isinstance(compressor, NoCompression):
        return ("any", math.inf)
    for attr in ("matrix_rank", "ratio", "levels", "budget"):
        value = getattr(compressor, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return (attr, float(value))
    lam = getattr(compressor, "lam", None)
    if isinstance(lam, (int, float)) and not isinstance(lam, bool):
        return ("lam", -float(lam))  # a higher threshold sends less
    return None


def check_level_order(steady: Compressor, critical: Compressor) -> None:
    """Warn when the critical level looks more aggressive than the steady one.

    Swapped levels are legal (the controller does what it is told) but almost always a
    mistake: Accordion would then compress *harder* in critical regimes.
    """
    low, high = gentleness(steady), gentleness(critical)
    if low is None or high is None or (high[0] != low[0] and high[0] != "any"):
        return
    if high[1] < low[1]:
        log.warning(
            "Accordion's critical level %r looks more aggressive than its steady level %r; "
            "the critical level should be the gentle one",
            critical.spec(), steady.spec(),
        )
