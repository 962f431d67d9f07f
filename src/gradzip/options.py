"""What an engine takes besides its compressor, in one frozen record; per-parameter rules.

:class:`EngineOptions` is passed whole through :class:`~gradzip.Engine`, the DDP hook state,
:func:`~gradzip.ddp.make_hook`, :func:`~gradzip.ddp.register`, the framework integrations and
the runner. Each of them also takes the record's fields as keyword arguments
(``register(ddp_model, "topk:ratio=0.01", dense_1d=True)``), validated against the record: one
list of options, documented once, here.

Where tensors go (:func:`route`), in this order:

1. tensors with fewer than ``min_numel`` entries: one exact all-reduce, no residual;
2. ``dense_1d=True``: tensors of fewer than two dimensions, likewise (the rule
   ``Rule("*", "dense", max_ndim=1)`` placed before ``rules``);
3. the first of ``rules`` whose glob matches the parameter's name: that rule's compressor
   (with its own state), or an exact all-reduce for the spec ``"dense"``;
4. every other tensor: the engine's main compressor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch

from gradzip._validate import check_bool, check_choice, check_int
from gradzip.compressors.base import Compressor
from gradzip.spec import compressor_from_spec

__all__ = ["DENSE", "DENSE_ROUTE", "MAIN_ROUTE", "NONFINITE_POLICIES", "EngineOptions", "Rule",
           "route"]

NONFINITE_POLICIES = ("skip", "zero", "raise")
#: The rule spec that sends matching tensors uncompressed: one exact all-reduce, no residual.
DENSE = "dense"
#: :func:`route`'s values: exact all-reduce, the main compressor; rule ``i`` is ``i + 1``.
DENSE_ROUTE = -1
MAIN_ROUTE = 0


@dataclass(frozen=True)
class Rule:
    """Which compressor reduces the parameters whose names match a glob.

    Args:
        pattern: an ``fnmatch`` glob over parameter names (case-sensitive; ``*`` also matches
            dots), e.g. ``"*.bias"``, ``"encoder.layers.*"``, ``"embed*"``.
        spec: a compressor or spec string (``"topk:ratio=0.1"``, an ``"accordion(...)"``
            spec), or ``"dense"`` for an exact all-reduce without residual.
        max_ndim: match only tensors of at most this many dimensions (``None``: any).

    Raises:
        TypeError, ValueError: an empty or non-string pattern, an invalid spec (named with
            the rule), a negative ``max_ndim``.
    """

    pattern: str
    spec: Compressor | str
    max_ndim: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str) or not self.pattern.strip():
            raise TypeError(f"rule `pattern` must be a non-empty glob string, got {self.pattern!r}")
        object.__setattr__(self, "pattern", self.pattern.strip())
        if isinstance(self.spec, str) and self.spec.strip() == DENSE:
            object.__setattr__(self, "spec", DENSE)
        else:
            try:
                object.__setattr__(self, "spec", compressor_from_spec(self.spec))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"rule {self.pattern!r}: {exc}") from None
        if self.max_ndim is not None:
            check_int("max_ndim", self.max_ndim, minimum=0)

    @classmethod
    def parse(cls, text: str) -> Rule:
        """``"PATTERN=SPEC"`` (the CLI's ``--rule``), split at the first ``=``.

        Raises:
            ValueError: no ``=``, an empty side, or an invalid spec.
        """
        if not isinstance(text, str):
            raise TypeError(f"`rule` must be a 'PATTERN=SPEC' string, got {text!r}")
        pattern, eq, spec = text.partition("=")
        if not eq or not pattern.strip() or not spec.strip():
            raise ValueError(f"`rule` must be PATTERN=SPEC, e.g. '*.bias=dense', got {text!r}")
        return cls(pattern.strip(), spec.strip())  # whitespace around `=` ignored, as in specs

    @property
    def compressor(self) -> Compressor | None:
        """The rule's compressor; ``None`` for ``"dense"``."""
        return None if self.spec == DENSE else self.spec  # type: ignore[return-value]

    def matches(self, name: str, shape: torch.Size) -> bool:
        """Whether the rule applies to parameter ``name`` of ``shape``."""
        if self.max_ndim is not None and len(shape) > self.max_ndim:
            return False
        return fnmatchcase(name, self.pattern)

    def describe(self) -> str:
        """``PATTERN=SPEC`` (plus the dimension limit): stored in checkpoints, compared across
        ranks."""
        spec = DENSE if self.compressor is None else self.compressor.spec()
        limit = "" if self.max_ndim is None else f" [ndim<={self.max_ndim}]"
        return f"{self.pattern}={spec}{limit}"


def _rules(value: Any) -> tuple[Rule, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (Iterable, Mapping)):
        raise TypeError(
            f"`rules` must be a sequence of (pattern, spec) pairs, got {type(value).__name__}"
        )
    items = list(value.items()) if isinstance(value, Mapping) else list(value)
    out = []
    for item in items:
        if isinstance(item, Rule):
            out.append(item)
        elif isinstance(item, str):
            out.append(Rule.parse(item))
        elif isinstance(item, tuple) and len(item) in (2, 3):
            out.append(Rule(*item))
        else:
            raise TypeError(f"`rules` must hold (pattern, spec) pairs, got {item!r}")
    return tuple(out)


@dataclass(frozen=True)
class EngineOptions:
    """Everything an engine takes besides its compressor and where workers meet.

    Args:
        error_feedback: keep and re-add what was not sent. ``None`` follows each compressor
            (on for biased ones: all but none/fp16/bf16/qsgd), the main one and every rule's
            alike; ``True``/``False`` forces it for all of them.
        nonfinite: what to do when any worker's gradient holds NaN/Inf, or compression
            overflows (the gradient plus its residual, a scale, PowerSGD's factors, the
            average or a compressor's state turn non-finite), decided identically on every
            worker. ``"skip"`` (default): the whole step is rolled back (residuals, warm
            starts, controllers as before it) and this call and every later call of the step
            return NaN, so a ``GradScaler`` (or any finite check) skips the optimizer step.
            ``"zero"``: the call is dropped (zeros returned, its tensors' state as before the
            call) while the step's other calls stand. ``"raise"``: ``FloatingPointError`` on
            every worker and the step is abandoned (state as before it).
            ``stats["skipped_steps"]`` counts the steps handled by ``"skip"`` or ``"zero"``.
        optimizer: read for the learning rate (adaptive compressors react to its drops).
        grad_scaler: a ``torch.amp.GradScaler`` whose scaled gradients the engine sees.
            Residuals are kept at the loss scale they were made at; when the scaler changes
            its scale they are multiplied by the ratio (a power of two: exact).
        dense_1d: send tensors of fewer than two dimensions (biases, normalisation weights)
            uncompressed: one exact all-reduce per call, no error feedback, never seen by a
            compressor, as PyTorch's PowerSGD hook and the Accordion reference code do. Sugar
            for the rule ``Rule("*", "dense", max_ndim=1)`` placed before ``rules``.
        rules: ordered ``(glob, spec)`` pairs (or :class:`Rule` objects, or ``"GLOB=SPEC"``
            strings, or a mapping glob -> spec): the first rule whose glob matches a
            parameter's name decides its compressor; unmatched tensors use the main one. Each
            rule's compressor keeps its own state (and checkpoint entry); ``"dense"`` sends
            exactly. E.g. ``[("*.bias", "dense"), ("embed*", "topk:ratio=0.1")]``.
        min_numel: tensors with fewer entries are all-reduced exactly, without residual
            (CGX skips layers under 1,024 entries); 0 (default) sends every tensor through
            its compressor.

    Raises:
        TypeError, ValueError: an invalid value, naming the option.

    Examples:
        >>> options = EngineOptions(rules=[("*.bias", "dense")], min_numel=1024)
        >>> engine = Engine(model, "powersgd:rank=2", options=options)
        >>> state = gradzip.ddp.register(ddp_model, "powersgd:rank=2", options=options)
    """

    error_feedback: bool | None = None
    nonfinite: str = "skip"
    optimizer: torch.optim.Optimizer | None = None
    grad_scaler: Any = None
    dense_1d: bool = False
    rules: tuple[Rule, ...] = ()
    min_numel: int = 0

    def __post_init__(self) -> None:
        if self.error_feedback is not None and not isinstance(self.error_feedback, bool):
            raise TypeError(f"`error_feedback` must be a bool or None, got {self.error_feedback!r}")
        check_choice("nonfinite", self.nonfinite, NONFINITE_POLICIES)
        if self.optimizer is not None and not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"`optimizer` must be a torch.optim.Optimizer, got {type(self.optimizer).__name__}"
            )
        if self.grad_scaler is not None and not callable(getattr(self.grad_scaler, "get_scale", None)):
            raise TypeError(
                f"`grad_scaler` must be a torch.amp.GradScaler, got {type(self.grad_scaler).__name__}"
            )
        check_bool("dense_1d", self.dense_1d)
        object.__setattr__(self, "rules", _rules(self.rules))
        check_int("min_numel", self.min_numel, minimum=0)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The options' names (the keyword arguments every entry point accepts)."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def build(cls, options: EngineOptions | None = None, /, **keywords: Any) -> EngineOptions:
        """``options`` (default: all defaults) with ``keywords`` replacing its fields.

        Raises:
            TypeError: ``options`` is not an ``EngineOptions``, or a keyword is not an option
                (named).
            ValueError: an invalid value (named).
        """
        if options is not None and not isinstance(options, EngineOptions):
            raise TypeError(f"`options` must be a gradzip.EngineOptions, got {type(options).__name__}")
        unknown = sorted(set(keywords) - set(cls.names()))
        if unknown:
            raise TypeError(
                f"unexpected keyword argument {unknown[0]!r}: engine options are "
                f"{', '.join(cls.names())}"
            )
        base = options if options is not None else cls()
        return dataclasses.replace(base, **keywords) if keywords else base

    def routing_rules(self) -> tuple[Rule, ...]:
        """``rules`` with the ``dense_1d`` rule first when it is on."""
        sugar = (Rule("*", DENSE, max_ndim=1),) if self.dense_1d else ()
        return sugar + self.rules

    def feedback_for(self, compressor: Compressor) -> bool:
        """Whether tensors reduced by ``compressor`` keep a residual."""
        if self.error_feedback is not None:
            return self.error_feedback
        return bool(getattr(compressor, "biased", True))


def route(shapes: Mapping[str, torch.Size], options: EngineOptions) -> dict[str, int]:
    """Where each tensor goes: :data:`DENSE_ROUTE`, :data:`MAIN_ROUTE`, or ``i + 1`` for
    ``options.rules[i]`` (see the module docstring for the order of precedence).

    A pure function of names, shapes and options, so every rank routes alike once the
    configuration handshake has checked that they agree.
    """
    sugar = len(options.routing_rules()) - len(options.rules)
    out = {}
    for name, shape in shapes.items():
        where = MAIN_ROUTE
        if torch.Size(shape).numel() < options.min_numel:
            where = DENSE_ROUTE
        else:
            for i, rule in enumerate(options.routing_rules()):
                if rule.matches(name, torch.Size(shape)):
                    where = DENSE_ROUTE if rule.compressor is None else i - sugar + 1
                    break
        out[name] = where
    return out
