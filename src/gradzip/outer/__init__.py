"""Outer-step training (the DiLoCo family): pseudo-gradients through the engine.

:class:`Outer` is the wrapper a user holds; :class:`OuterOptimizer` the outer step;
:class:`FragmentPlan` and :func:`split_fragments` the streaming schedule;
:func:`outer_defaults` the default outer lr and momentum at a given ``H``.
"""

from gradzip.outer.defaults import outer_defaults
from gradzip.outer.fragments import FragmentPlan, split_fragments
from gradzip.outer.optim import OUTER_KINDS, OuterOptimizer
from gradzip.outer.outer import Outer

__all__ = ["OUTER_KINDS", "FragmentPlan", "Outer", "OuterOptimizer", "outer_defaults", "split_fragments"]
