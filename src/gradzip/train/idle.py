"""Run options that act on nothing in a given configuration, and their refusal.

SGD's ``momentum`` and ``nesterov`` mean nothing to AdamW; Accordion's ``eta`` and
``interval_epochs`` mean nothing without Accordion or the batch-size controller. Given, they
are refused with one line naming them (a run that silently ignores an option is not the run
that was asked for); not given, they are not filled from the task's defaults, so a resolved
configuration records what ran and is no part of the result key.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ETA_DEFAULT", "check_idle_options", "idle_options"]

#: Accordion's ``eta`` when not given (an ``eta`` other than this needs a controller).
ETA_DEFAULT = 0.5


def idle_options(cfg: Any) -> set[str]:
    """The run options that act on nothing in ``cfg`` (a :class:`~gradzip.train.config.RunConfig`)."""
    idle = set()
    if cfg.optimizer == "adamw":
        idle |= {"momentum", "nesterov"}
    if cfg.accordion is None and cfg.accordion_batch is None:
        idle |= {"eta", "interval_epochs"}
    return idle


def check_idle_options(cfg: Any) -> None:
    """Refuse an option given where it acts on nothing (``eta``: other than its default; the
    others: set at all, since the task's defaults do not fill them there).

    Raises:
        ValueError: naming the option, what it needs and the value given.
    """
    idle = idle_options(cfg)
    for name, what in (("momentum", "SGD's momentum; AdamW's betas are 0.9, 0.95"),
                       ("nesterov", "SGD's Nesterov momentum")):
        if name in idle and getattr(cfg, name) is not None:
            raise ValueError(f"`{name}` must be unset with `optimizer` 'adamw' ({what}), got "
                             f"{name}={getattr(cfg, name)}")
    for name, what, unset in (("eta", "tunes", ETA_DEFAULT), ("interval_epochs", "times", None)):
        if name in idle and getattr(cfg, name) != unset:
            raise ValueError(f"`{name}` needs `accordion` or `accordion_batch` (it {what} their "
                             f"decisions), got {name}={getattr(cfg, name)}")
