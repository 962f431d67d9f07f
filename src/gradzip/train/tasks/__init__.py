"""The task registry: what a run trains, on which data, with which defaults.

One module per task (``digits``, ``cifar10``, ``lm``, ``logreg``), each holding its task class
and its ``TASK`` (name, description, defaults, models); :mod:`.base` holds what they share.
Adding a task: a module with its ``TASK``, and one line in ``TASKS`` below.
"""

from __future__ import annotations

from gradzip.train.tasks import cifar10, digits, lm, logreg
from gradzip.train.tasks.base import Defaults, Task, parse_model_spec

__all__ = ["TASKS", "Defaults", "Task", "get_task", "parse_model_spec"]

#: ``name -> task``, in the order ``gradzip list`` shows them.
TASKS: dict[str, Task] = {t.name: t for t in (digits.TASK, cifar10.TASK, lm.TASK, logreg.TASK)}


def get_task(name: str) -> Task:
    """The registered task called ``name``.

    Raises:
        ValueError: unknown name.
    """
    if name not in TASKS:
        raise ValueError(f"`task` must be one of {', '.join(TASKS)}, got {name!r}")
    return TASKS[name]
