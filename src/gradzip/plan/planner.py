"""``predict`` every candidate in a setting, and ``choose`` one under a quality guard."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gradzip._validate import check_real, check_shape
from gradzip.plan.candidates import QUALITIES, Candidate, default_candidates
from gradzip.plan.model import Prediction, Setting, predict_candidate
from gradzip.plan.step_cost import outer_step_cost
from gradzip.plan.timing import TimingCache
from gradzip.plan.traffic import count_layout, measure_traffic

__all__ = ["Plan", "choose", "parse_count", "plan", "predict", "priced_ms"]

_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9}


def parse_count(text: str | int) -> int:
    """A parameter count: an integer, or a number with a K, M or G (B) suffix (``"25M"``).

    Raises:
        TypeError: not a string or an integer.
        ValueError: not a positive count.
    """
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise TypeError(f"`params` must be a count such as 25M or 1200000, got {text!r}")
    if isinstance(text, int):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kKmMgGbB]?)\s*", text)
        if m is None:
            raise ValueError(f"`params` must be a count such as 25M or 1200000, got {text!r}")
        value = float(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if value < 1 or value != value:
        raise ValueError(f"`params` must be >= 1, got {text!r}")
    return int(round(value))


@dataclass(frozen=True)
class Plan:
    """A plan: every prediction, the quality classes considered, the choice and why.

    Attributes:
        setting: the inputs.
        params: the model's parameter count.
        predictions: one per candidate, in the candidates' order.
        considered: the quality classes the choice was made among.
        choice: the chosen prediction.
        reason: one line saying why.
    """

    setting: Setting
    params: int
    predictions: tuple[Prediction, ...]
    considered: tuple[str, ...]
    choice: Prediction
    reason: str

    def prediction(self, name: str) -> Prediction:
        """The prediction of the candidate called ``name``."""
        for p in self.predictions:
            if p.candidate.name == name:
                return p
        raise KeyError(name)

    def as_dict(self) -> dict[str, object]:
        """Plain data for JSON."""
        s = self.setting
        return {"setting": {"workers": s.workers, "bandwidth_mbit": s.bandwidth_mbit,
                            "rtt_ms": s.rtt_ms, "step_ms": s.step_ms, "buckets": s.buckets,
                            "overlap": s.overlap, "backward_fraction": s.backward_fraction},
                "params": self.params, "considered": list(self.considered),
                "choice": self.choice.candidate.name, "reason": self.reason,
                "predictions": [p.as_dict() for p in self.predictions],
                "step_costs": {p.candidate.name: outer_step_cost(p.candidate.outer_steps)
                               for p in self.predictions if p.candidate.outer_steps}}


def _shapes(shapes: Mapping[str, Sequence[int]] | None,
            params: int | str | None) -> tuple[dict[str, tuple[int, ...]] | None, int | None]:
    if (shapes is None) == (params is None):
        raise ValueError("exactly one of `shapes` and `params` must be given, got "
                         f"{'both' if shapes is not None else 'neither'}")
    if params is not None:
        return None, parse_count(params)
    if not isinstance(shapes, Mapping) or not shapes:
        raise TypeError(f"`shapes` must be a non-empty mapping name -> shape, got {shapes!r}")
    return {str(n): tuple(check_shape(f"`shapes`[{n!r}]", s)) for n, s in shapes.items()}, None


def predict(setting: Setting, *, shapes: Mapping[str, Sequence[int]] | None = None,
            params: int | str | None = None, candidates: Sequence[Candidate] | None = None,
            compress_seconds: Mapping[str, float] | None = None,
            timings: TimingCache | None = None, measure: bool = True) -> tuple[Prediction, ...]:
    """Predict every candidate's bytes, calls, link time and step time.

    Args:
        setting: workers, link and compute.
        shapes: the model's parameter shapes (``name -> shape``); or
        params: a parameter count (``25_000_000`` or ``"25M"``).
        candidates: what to weigh (default :func:`default_candidates`).
        compress_seconds: ``spec -> seconds`` of compression per exchange, used as given
            (tests inject them; specs missing here come from ``timings``).
        timings: the cache of measured compression times (default: the user's cache file).
        measure: measure (and cache) compression times missing from the cache; if false
            they count as 0 and are reported as not measured.

    Returns:
        One :class:`Prediction` per candidate, in order.

    Raises:
        TypeError, ValueError: invalid arguments, naming the parameter.
    """
    if not isinstance(setting, Setting):
        raise TypeError(f"`setting` must be a Setting, got {type(setting).__name__}")
    named, count = _shapes(shapes, params)
    cands = tuple(default_candidates() if candidates is None else candidates)
    if not cands or not all(isinstance(c, Candidate) for c in cands):
        raise TypeError(f"`candidates` must be a non-empty sequence of Candidate, got {cands!r}")
    if compress_seconds is not None:
        if not isinstance(compress_seconds, Mapping):
            raise TypeError(f"`compress_seconds` must be a mapping spec -> seconds, got "
                            f"{compress_seconds!r}")
        for spec, value in compress_seconds.items():
            check_real(f"compress_seconds[{spec!r}]", value, low=0)
    layout = named if named is not None else count_layout(count)  # type: ignore[arg-type]
    traffic: dict[str, object] = {}
    seconds: dict[str, float | None] = {}
    out = []
    for cand in cands:
        if cand.spec not in traffic:
            traffic[cand.spec] = measure_traffic(cand.spec, setting.workers, shapes=named,
                                                 params=count)
            given = None if compress_seconds is None else compress_seconds.get(cand.spec)
            if given is None:
                cache = timings if timings is not None else TimingCache()
                timings = cache
                given = cache.seconds(cand.spec, layout, measure=measure)
            seconds[cand.spec] = given
        out.append(predict_candidate(cand, traffic[cand.spec], setting,  # type: ignore[arg-type]
                                     seconds[cand.spec]))
    return tuple(out)


def priced_ms(prediction: Prediction) -> float:
    """What :func:`choose` compares: time per step, times the step cost of an outer-step
    candidate's ``H`` (:func:`~gradzip.plan.step_cost.outer_step_cost`: a rarer
    synchronisation makes each step worth less)."""
    h = prediction.candidate.outer_steps
    return prediction.step_ms * (outer_step_cost(h) if h else 1.0)


def choose(predictions: Sequence[Prediction], *, qualities: Sequence[str] = QUALITIES,
           margin: float = 0.05) -> tuple[Prediction, str]:
    """The choice among ``predictions`` whose quality class is in ``qualities``.

    The quality guard: classes are taken from the least to the most change to training
    (:data:`QUALITIES`); a class's fastest candidate replaces the choice so far only when it is
    predicted more than ``margin`` faster, so a fast link keeps ``none``. Outer-step
    candidates are compared at their time per step times their step cost (:func:`priced_ms`).

    Args:
        predictions: from :func:`predict`.
        qualities: the classes allowed.
        margin: the fraction a more lossy class must gain, in [0, 1).

    Returns:
        ``(choice, reason)``.

    Raises:
        ValueError: no prediction in the allowed classes; a bad class or margin.
    """
    margin = check_real("margin", margin, low=0, high=1, high_open=True)
    if isinstance(qualities, str) or not all(q in QUALITIES for q in qualities) or not qualities:
        raise ValueError(f"`qualities` must be a non-empty list among {', '.join(QUALITIES)}, "
                         f"got {qualities!r}")
    allowed = [p for p in predictions if p.candidate.quality in qualities]
    if not allowed:
        raise ValueError(f"`qualities` must include a class of some candidate, got {qualities!r}")
    choice: Prediction | None = None
    for quality in QUALITIES:
        group = [p for p in allowed if p.candidate.quality == quality]
        if not group:
            continue
        best = min(group, key=priced_ms)
        if choice is None or priced_ms(best) < priced_ms(choice) * (1 - margin):
            choice = best
    assert choice is not None
    none = next((p for p in predictions if p.candidate.spec == "none"
                 and not p.candidate.outer_steps), None)
    gain = f", {none.step_ms / choice.step_ms:.2f}x none" if none is not None else ""
    h = choice.candidate.outer_steps
    worth = f" (x{outer_step_cost(h):.2f} step cost at H={h})" if h else ""
    reason = (f"{choice.candidate.name} ({choice.candidate.spec}"
              f"{', ' + choice.candidate.describe_outer() if h else ''}):"
              f" {choice.step_ms:.1f} ms/step predicted{worth}{gain}; fastest of the classes "
              f"{', '.join(q for q in QUALITIES if q in qualities)} (a more lossy class must "
              f"gain {margin:.0%})")
    return choice, reason


def plan(setting: Setting, *, shapes: Mapping[str, Sequence[int]] | None = None,
         params: int | str | None = None, qualities: Sequence[str] = QUALITIES,
         margin: float = 0.05, **kwargs: object) -> Plan:
    """:func:`predict` then :func:`choose`; returns the :class:`Plan` (arguments as theirs)."""
    preds = predict(setting, shapes=shapes, params=params, **kwargs)  # type: ignore[arg-type]
    choice, reason = choose(preds, qualities=qualities, margin=margin)
    named, count = _shapes(shapes, params)
    total = count if count is not None else sum(_numel(s) for s in named.values())  # type: ignore[union-attr]
    return Plan(setting, total, preds, tuple(q for q in QUALITIES if q in qualities), choice,
                reason)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
