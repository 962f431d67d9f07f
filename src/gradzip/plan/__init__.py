"""The cost model: which way of communicating is fastest for a model, a link and a machine.

:func:`predict` gives, for every candidate (per-step compressors and outer-step training),
the wire bytes and collective calls per step, the link time (alpha-beta), the compression
time and the step time; :func:`choose` picks one under a quality guard; :func:`plan` does
both. ``gradzip plan`` is the same on the command line.
"""

from gradzip.plan.auto import DEFAULT_LEVELS, Auto
from gradzip.plan.candidates import QUALITIES, Candidate, default_candidates
from gradzip.plan.model import Prediction, Setting, comm_seconds, predict_candidate
from gradzip.plan.planner import Plan, choose, parse_count, plan, predict, priced_ms
from gradzip.plan.step_cost import STEP_COSTS, outer_step_cost
from gradzip.plan.switch import OUTER_CANDIDATES, outer_switch, outer_switch_bound
from gradzip.plan.timing import TimingCache, measure_compress_seconds
from gradzip.plan.traffic import Call, Traffic, count_layout, measure_traffic
from gradzip.plan.traffic_cache import TrafficCache

__all__ = [
    "DEFAULT_LEVELS",
    "OUTER_CANDIDATES",
    "STEP_COSTS",
    "Auto",
    "QUALITIES",
    "Call",
    "Candidate",
    "Plan",
    "Prediction",
    "Setting",
    "TimingCache",
    "Traffic",
    "TrafficCache",
    "choose",
    "comm_seconds",
    "count_layout",
    "default_candidates",
    "measure_compress_seconds",
    "measure_traffic",
    "outer_step_cost",
    "outer_switch",
    "outer_switch_bound",
    "parse_count",
    "plan",
    "predict",
    "priced_ms",
    "predict_candidate",
]
