"""The run options of outer-step training and of the inner optimizer (fields of
:class:`~gradzip.train.config.RunConfig`, declared here to keep that module small)."""

from __future__ import annotations

import dataclasses
from typing import Any

from gradzip._validate import check_bool, check_int
from gradzip.outer.optim import OUTER_KINDS, OuterOptimizer
from gradzip.plan.auto import Auto
from gradzip.spec import CONTROLLERS, compressor_from_spec
from gradzip.train.fields import OPTIM, int_at_least, option, real_in

__all__ = ["AUTO_OUTER_EXCHANGES", "AUTO_OUTER_STEPS", "INNER_OPTIMIZERS", "OUTER", "OuterFields",
           "outer_exchanges_list", "outer_steps_list"]

#: The optimizer each worker steps (``adamw``: betas 0.9, 0.95, with ``--weight-decay``).
INNER_OPTIMIZERS = ("sgd", "adamw")
#: The ``gradzip train --help`` section.
OUTER = "outer-step training (DiLoCo family)"
#: The ``H`` values ``--auto-outer`` weighs by default.
AUTO_OUTER_STEPS = (10, 30, 100)
#: The exchanges ``--auto-outer`` weighs at each ``H`` by default: dense, and 8-bit with error
#: feedback (BENCHMARKS section 5: DiLoCo 8-bit at H = 30 ended at 443.3 perplexity against
#: dense's 449.0, three seeds, with 4x fewer bytes).
AUTO_OUTER_EXCHANGES = ("none", "scatterq:bits=8")


def outer_steps_list(value: Any) -> tuple[int, ...]:
    """``auto_outer_steps`` as a tuple of distinct integers >= 1 (text: ``"10,30,100"``).

    Raises:
        ValueError, TypeError: not such a list, naming ``auto_outer_steps``.
    """
    if isinstance(value, str):
        try:
            value = [int(v) for v in value.replace(" ", "").split(",") if v]
        except ValueError:
            raise ValueError("`auto_outer_steps` must be comma-separated integers, got "
                             f"{value!r}") from None
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"`auto_outer_steps` must be a non-empty list of H values, got {value!r}")
    steps = tuple(check_int("auto_outer_steps", v, minimum=1) for v in value)
    if len(set(steps)) != len(steps):
        raise ValueError(f"`auto_outer_steps` must not repeat a value, got {list(steps)}")
    return steps


def outer_exchanges_list(value: Any) -> tuple[str, ...]:
    """``auto_outer_exchanges`` as a tuple of distinct compressor specs of per-step
    compressors (not controllers), at least one (``None``, a repeatable flag not given:
    :data:`AUTO_OUTER_EXCHANGES`).

    Raises:
        ValueError, TypeError: not such a list, naming ``auto_outer_exchanges``.
    """
    if value is None:
        return AUTO_OUTER_EXCHANGES
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value or any(
            not isinstance(v, str) for v in value):
        raise ValueError(f"`auto_outer_exchanges` must be a non-empty list of compressor specs, "
                         f"got {value!r}")
    specs = []
    for text in value:
        try:
            built = compressor_from_spec(text.strip())
        except (TypeError, ValueError) as err:
            raise ValueError(f"`auto_outer_exchanges` must hold compressor specs, got "
                             f"{text!r}: {err}") from None
        if type(built).spec_name in CONTROLLERS:  # Auto among them
            raise ValueError(f"`auto_outer_exchanges` must hold plain compressors, not "
                             f"controllers, got {text!r}")
        specs.append((text.strip(), built.spec()))
    stable = [b for _, b in specs]
    if len(set(stable)) != len(stable):
        raise ValueError(f"`auto_outer_exchanges` must not repeat a compressor, got "
                         f"{[t for t, _ in specs]}")
    return tuple(t for t, _ in specs)


@dataclasses.dataclass
class OuterFields:
    """Options of the inner optimizer and of outer-step training."""

    optimizer: str = option("sgd", "inner optimizer: sgd (default; --momentum, --nesterov) or "
                            "adamw (betas 0.9, 0.95)", group=OPTIM, choices=INNER_OPTIMIZERS)
    outer_steps: int = option(0, "outer-step training: synchronise the parameters' change every "
                              "H optimizer steps (0: off, every step's gradient is averaged)",
                              group=OUTER, metavar="H", check=int_at_least(0))
    outer_optimizer: str = option("nesterov", "nesterov (lr and momentum from H by the default "
                                  "rule, see docs: outer-step training), sgd (lr 1) or "
                                  "ef-momentum (decayed error feedback, always on, lr 1)", group=OUTER,
                                  choices=OUTER_KINDS)
    outer_lr: float | None = option(None, "outer learning rate (default: the outer optimizer's, at H)",
                                    group=OUTER, check=real_in(low=0, low_open=True))
    outer_momentum: float | None = option(None, "outer momentum (default: the outer optimizer's, at H)",
                                          group=OUTER, check=real_in(low=0, high=1, high_open=True))
    fragments: int = option(1, "streaming: fragments synchronised in turn (dividing H)",
                            group=OUTER, metavar="P", check=int_at_least(1))
    outer_delay: int = option(0, "streaming: inner steps between sending a fragment and applying "
                              "it (< H/P), the exchange overlapped with them", group=OUTER,
                              metavar="TAU", check=int_at_least(0))
    auto_outer: bool = option(False, "with --compressor auto: leave per-step communication for "
                              "outer-step training (DiLoCo, the exchanges of "
                              "--auto-outer-exchange, outer settings from H) at the first "
                              "decision past the critical phase where an outer candidate is "
                              "predicted faster by auto's margin; no switch back",
                              group=OUTER, check=check_bool)
    auto_outer_steps: tuple[int, ...] = option(
        AUTO_OUTER_STEPS, "the H values --auto-outer weighs (default 10,30,100)", group=OUTER,
        metavar="H1,H2")
    auto_outer_exchanges: tuple[str, ...] = option(
        AUTO_OUTER_EXCHANGES, "an exchange --auto-outer weighs at each H (repeatable; default: "
        "none and scatterq:bits=8, the dense and the 8-bit exchange), priced with its "
        "compression time measured on the model", group=OUTER, flag="--auto-outer-exchange",
        metavar="SPEC")
    auto_outer_early: bool = option(False, "with --auto-outer: the first decision may switch "
                                    "too (outer steps from the start, as DiLoCo runs; a "
                                    "learning-rate drop or a norm change still forbids it); "
                                    "with auto(warmup=0) it comes before step 0 and switches "
                                    "on any predicted gain",
                                    group=OUTER, check=check_bool)
    auto_outer_follow: bool = option(False, "with --auto-outer: once outer steps run, weigh "
                                     "the candidates again at each synchronisation from the "
                                     "compute and exchange times measured there, and change "
                                     "H or the exchange where two in a row choose another "
                                     "(candidates ranked by time per step times the measured "
                                     "step cost of their H)", group=OUTER, check=check_bool)
    auto_outer_bandwidth_mbit: float | None = option(
        None, "a link bandwidth --auto-outer prices with instead of the probed one (a known "
        "link the probe cannot see)", group=OUTER, metavar="MBIT",
        check=real_in(low=0, low_open=True))

    def check_outer(self) -> None:
        """The checks that span several of these options (one-line errors).

        Raises:
            ValueError: streaming options without ``outer_steps``, the batch-size controller
                with it, ``outer_steps`` not a multiple of ``fragments``, ``outer_delay`` not
                below ``outer_steps / fragments``, an outer momentum the outer optimizer
                cannot take, error feedback off under ``ef-momentum``, or ``auto_outer``
                with an option it does not take (see :meth:`check_auto_outer`).
        """
        self.check_auto_outer()
        h, p, tau = self.outer_steps, self.fragments, self.outer_delay
        if not h:
            if p != 1 or tau or self.outer_lr is not None or self.outer_momentum is not None:
                raise ValueError("`fragments`, `outer_delay`, `outer_lr` and `outer_momentum` need "
                                 f"`outer_steps` >= 1, got outer_steps={h}")
            return
        batch = getattr(self, "accordion_batch", None)  # a RunConfig field
        if batch is not None:
            raise ValueError("`accordion_batch` must be unset with `outer_steps` (the batch-size "
                             f"controller reads per-step averaged gradients), got {batch}")
        if h % p:
            raise ValueError(f"`outer_steps` must be a multiple of `fragments` ({p}), got {h}")
        if tau >= h // p:
            raise ValueError(f"`outer_delay` must be below outer_steps / fragments ({h // p}), got {tau}")
        feedback = getattr(self, "error_feedback", None)  # a RunConfig field
        if self.outer_optimizer == "ef-momentum" and feedback is False:
            raise ValueError("`error_feedback` must be on for the ef-momentum `outer_optimizer` "
                             "(its residual is the momentum), got error_feedback=False")
        try:
            OuterOptimizer.build(self.outer_optimizer, lr=self.outer_lr, momentum=self.outer_momentum)
        except ValueError as err:
            raise ValueError(str(err).replace("`momentum`", "`outer_momentum`")) from None

    def check_auto_outer(self) -> None:
        """The checks of ``auto_outer`` and its options (one-line errors).

        Raises:
            ValueError: its options without it; or it with a compressor other than ``auto``
                alone, with ``outer_steps`` (the switch chooses H), a controller around the
                compressor, ``hsdp``, ``accordion_batch``, an outer optimizer other than
                Nesterov, or fewer than 2 workers.
        """
        steps = outer_steps_list(self.auto_outer_steps)
        if not self.auto_outer:
            if (steps != AUTO_OUTER_STEPS or self.auto_outer_bandwidth_mbit is not None
                    or self.auto_outer_early or self.auto_outer_follow
                    or outer_exchanges_list(self.auto_outer_exchanges) != AUTO_OUTER_EXCHANGES):
                raise ValueError("`auto_outer_steps`, `auto_outer_exchanges`, `auto_outer_early`, "
                                 "`auto_outer_follow` and `auto_outer_bandwidth_mbit` need "
                                 "`auto_outer`, got auto_outer=False")
            return
        compressor = getattr(self, "compressor", "none")  # RunConfig fields, as below
        if not isinstance(compressor_from_spec(compressor), Auto):
            raise ValueError("`compressor` must be auto (e.g. 'auto' or 'auto(every=20)') with "
                             f"`auto_outer`, got {compressor!r}")
        refused = [("outer_steps", self.outer_steps, 0, "the switch chooses H"),
                   ("accordion", getattr(self, "accordion", None), None, "auto is the controller"),
                   ("level_schedule", getattr(self, "level_schedule", None), None,
                    "auto is the controller"),
                   ("warmup_steps", getattr(self, "warmup_steps", 0), 0, "auto is the controller"),
                   ("hsdp", getattr(self, "hsdp", 0), 0, "sharded models are not switched"),
                   ("fsdp", getattr(self, "fsdp", False), False, "sharded models are not switched"),
                   ("accordion_batch", getattr(self, "accordion_batch", None), None,
                    "it reads per-step averaged gradients"),
                   ("outer_optimizer", self.outer_optimizer, "nesterov",
                    "the candidates' outer settings are Nesterov's")]
        for name, value, allowed, why in refused:
            if value != allowed:
                raise ValueError(f"`{name}` must be {allowed!r} with `auto_outer` ({why}), got "
                                 f"{value!r}")
        workers = getattr(self, "workers", 2)
        if workers < 2:
            raise ValueError(f"`workers` must be >= 2 with `auto_outer`, got {workers}")
