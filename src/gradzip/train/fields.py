"""How a run option is declared: the :class:`Option` each :class:`~gradzip.train.config.RunConfig`
field carries (its meaning, its check, its command-line form), and helpers to declare one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

from gradzip._validate import check_int, check_real

__all__ = ["ACCORDION", "OPTIM", "RUN", "SCHEDULE", "Option", "int_at_least", "option", "real_in"]

#: Sections of ``gradzip train --help``, in the order they appear.
RUN, ACCORDION, SCHEDULE, OPTIM = ("run", "accordion", "level schedule (instead of Accordion)",
                                   "optimisation (defaults: the task's)")


@dataclasses.dataclass(frozen=True)
class Option:
    """How one :class:`~gradzip.train.config.RunConfig` field is documented, checked and offered on the command line.

    Attributes:
        help: what the field means (its documentation and its ``--help`` line; a negative
            flag's help describes the flag).
        group: the ``gradzip train --help`` section.
        metavar: the value's name in ``--help``.
        choices: the allowed values (checked by :func:`~gradzip.train.config.resolve_config`; argparse choices).
        check: ``check(name, value)``, applied by :func:`~gradzip.train.config.resolve_config` to a value that is
            not None (after the task's defaults are filled).
        flag: the flag when it is not ``--field-name`` (``--no-scale-lr``, ``--rule``).
        cli: whether the field is a command-line option.
        required: whether the command line requires it.
    """

    help: str
    group: str = RUN
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    check: Callable[[str, Any], Any] | None = None
    flag: str | None = None
    cli: bool = True
    required: bool = False


def option(default: Any, help: str, **kwargs: Any) -> Any:
    """A field with its :class:`Option`."""
    return dataclasses.field(default=default, metadata={"option": Option(help, **kwargs)})


def int_at_least(minimum: int) -> Callable[[str, Any], int]:
    """A check: an integer >= ``minimum``."""
    return partial(check_int, minimum=minimum)


def real_in(**bounds: Any) -> Callable[[str, Any], float]:
    """A check: a real number within ``bounds`` (see :func:`~gradzip._validate.check_real`)."""
    return partial(check_real, **bounds)
