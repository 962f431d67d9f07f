"""The run options of outer-step training and of the inner optimizer (fields of
:class:`~gradzip.train.config.RunConfig`, declared here to keep that module small)."""

from __future__ import annotations

import dataclasses

from gradzip.outer.optim import OUTER_KINDS, OuterOptimizer
from gradzip.train.fields import OPTIM, int_at_least, option, real_in

__all__ = ["INNER_OPTIMIZERS", "OUTER", "OuterFields"]

#: The optimizer each worker steps (``adamw``: betas 0.9, 0.95, with ``--weight-decay``).
INNER_OPTIMIZERS = ("sgd", "adamw")
#: The ``gradzip train --help`` section.
OUTER = "outer-step training (DiLoCo family)"


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

    def check_outer(self) -> None:
        """The checks that span several of these options (one-line errors).

        Raises:
            ValueError: streaming options without ``outer_steps``, the batch-size controller
                with it, ``outer_steps`` not a multiple of ``fragments``, ``outer_delay`` not
                below ``outer_steps / fragments``, an outer momentum the outer optimizer
                cannot take, or error feedback off under ``ef-momentum``.
        """
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
