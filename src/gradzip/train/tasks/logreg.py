"""The logistic-regression task: a LIBSVM file or a generated separable problem."""

from __future__ import annotations

from typing import Any

from torch import nn

from gradzip.train import data as D
from gradzip.train import tabular as TB
from gradzip.train.tasks.base import Defaults, Task, data_option, new_model

__all__ = ["TASK", "LogRegTask"]


class LogRegTask(Task):
    """Logistic regression on a LIBSVM file (``--data``) or a generated separable problem."""

    def load(self, cfg: Any) -> D.TaskData:
        if cfg.data is None:
            data = TB.make_logreg_problem(n=2000, d=100, seed=cfg.seed)
        else:
            with data_option():
                data = TB.load_libsvm(cfg.data, seed=cfg.seed)
        return self._limit(data, cfg.limit_train, cfg.seed)

    def build_model(self, cfg: Any, data: Any) -> nn.Module:
        extra = {"num_features": int(data.train.x[0].numel())} if cfg.model.startswith("logreg") else {}
        return new_model(cfg.model, data.num_classes, cfg.seed, **extra)


#: The task with its defaults and the models it accepts.
TASK = LogRegTask(
    "logreg", "logistic regression: LIBSVM file (--data) or a generated problem",
    Defaults(model="logreg", epochs=10, batch_size=32, lr=0.1, momentum=0.0,
             milestones=(0.5, 0.75), interval_epochs=2.0, threads=1),
    models=("logreg",),
)
