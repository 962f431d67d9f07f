"""The step cost of outer-step candidates (gradzip.plan.step_cost) and how choices use it."""

from __future__ import annotations

import math

import pytest

from gradzip.plan import STEP_COSTS, Candidate, Prediction, choose, outer_step_cost, priced_ms


def test_the_measured_points_and_log_linear_between_and_beyond() -> None:
    for h, cost in STEP_COSTS.items():
        assert outer_step_cost(h) == pytest.approx(cost)
    assert outer_step_cost(1) == outer_step_cost(9) == 1.0
    # Halfway between 30 and 100 in log H is halfway between their costs.
    mid = round(math.sqrt(30 * 100))
    assert outer_step_cost(mid) == pytest.approx(
        1.15 + (math.log(mid) - math.log(30)) / (math.log(100) - math.log(30)) * (1.34 - 1.15))
    # Beyond 100 the last segment's slope goes on: grows, never drops.
    costs = [outer_step_cost(h) for h in (10, 20, 30, 60, 100, 300, 1000)]
    assert costs == sorted(costs) and costs[-1] > STEP_COSTS[100]


@pytest.mark.parametrize("h", [0, -3, 2.5, "30", True])
def test_bad_h_is_refused_naming_it(h: object) -> None:
    with pytest.raises((TypeError, ValueError), match="`h`"):
        outer_step_cost(h)  # type: ignore[arg-type]


def _prediction(candidate: Candidate, step_ms: float) -> Prediction:
    return Prediction(candidate=candidate, wire_bytes=0, payload_bytes=0, calls=0, comm_ms=0.0,
                      exposed_comm_ms=0.0, compress_ms=0.0, step_ms=step_ms, exact_bytes=True)


def test_choose_ranks_outer_candidates_by_time_times_step_cost() -> None:
    h10 = _prediction(Candidate("diloco-h10", "none", "outer", 10), 100.0)
    h100 = _prediction(Candidate("diloco-h100", "none", "outer", 100), 80.0)
    assert priced_ms(h10) == 100.0 and priced_ms(h100) == pytest.approx(80.0 * 1.34)
    # 20% less time per step does not pay for H = 100's 34% step cost ...
    choice, reason = choose([h10, h100], qualities=["outer"], margin=0.0)
    assert choice is h10 and "x1.00 step cost at H=10" in reason
    # ... 30% does (56 x 1.34 = 75 < 100).
    h100_fast = _prediction(h100.candidate, 56.0)
    choice, reason = choose([h10, h100_fast], qualities=["outer"], margin=0.0)
    assert choice is h100_fast and "x1.34 step cost at H=100" in reason
    # Per-step candidates keep their time.
    plain = _prediction(Candidate("none", "none", "lossless"), 90.0)
    assert priced_ms(plain) == 90.0
    assert choose([plain, h10], margin=0.05)[0] is plain
