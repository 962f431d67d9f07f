"""The engine: the one stateful object a user holds, a step as an explicit transaction.

Modules, from the bottom up: :mod:`~gradzip.engine.step` (the step in progress: snapshot,
calls, non-finite flags), :mod:`~gradzip.engine.routing` (which compressor reduces which
tensor), :mod:`~gradzip.engine.error` (the compression-error meter),
:mod:`~gradzip.engine.deferred` (rollback by ``torch.where``), :mod:`~gradzip.engine.base`
(configuration, state, counters), :mod:`~gradzip.engine.call` (one call and the fragments
every path shares), :mod:`~gradzip.engine.policy` (the non-finite policy, host and device
forms), the paths :mod:`~gradzip.engine.host`, :mod:`~gradzip.engine.device` and
:mod:`~gradzip.engine.flat`, :mod:`~gradzip.engine.checkpoint`, and
:mod:`~gradzip.engine.core`, where :class:`Engine` runs a step top to bottom.
"""

from gradzip.engine.base import DECIDE_ON, STATS_KEYS
from gradzip.engine.checkpoint import FORMAT_VERSION
from gradzip.engine.core import Engine
from gradzip.engine.flat import BucketLayout
from gradzip.options import NONFINITE_POLICIES

__all__ = ["DECIDE_ON", "FORMAT_VERSION", "NONFINITE_POLICIES", "STATS_KEYS", "BucketLayout",
           "Engine"]
