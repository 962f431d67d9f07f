"""The digits task: 8x8 handwritten digits embedded in the package, a small CNN."""

from __future__ import annotations

from typing import Any

from gradzip.train import data as D
from gradzip.train.tasks.base import Defaults, Task

__all__ = ["TASK", "DigitsTask"]


class DigitsTask(Task):
    """8x8 handwritten digits, embedded in the package: no download."""

    def load(self, cfg: Any) -> D.TaskData:
        return self._limit(D.load_digits(seed=cfg.seed), cfg.limit_train, cfg.seed)


#: The task with its defaults and the models it accepts.
TASK = DigitsTask(
    "digits", "8x8 handwritten digits (embedded, 1797 images, 80/20 split), small CNN",
    Defaults(model="digitsnet", epochs=12, batch_size=16, lr=0.025, weight_decay=1e-4,
             warmup_epochs=1.0, milestones=(0.5, 0.75), interval_epochs=2.0,
             threads=1),
    models=("digitsnet", "logreg"),
)
