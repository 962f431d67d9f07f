"""The CIFAR-10 task: the python release or an ImageFolder tree, ResNets and VGGs."""

from __future__ import annotations

from typing import Any

from gradzip.train import cifar as C
from gradzip.train import data as D
from gradzip.train.tasks.base import Defaults, Task, data_option

__all__ = ["TASK", "Cifar10Task"]


class Cifar10Task(Task):
    """CIFAR-10 from ``--data``: the python release or an ImageFolder tree (dir or .tar.gz)."""

    def load(self, cfg: Any) -> D.TaskData:
        kwargs: dict[str, Any] = {}
        if cfg.cache_dir is not None:
            kwargs["cache_dir"] = cfg.cache_dir
        with data_option():
            data = C.load_cifar10(cfg.data, **kwargs)
        return self._limit(data, cfg.limit_train, cfg.seed)


#: The task with its defaults and the models it accepts.
TASK = Cifar10Task(
    "cifar10", "CIFAR-10 from --data (python release or ImageFolder dir/.tar.gz)",
    Defaults(model="resnet20", epochs=300, batch_size=128, lr=0.1, weight_decay=1e-4,
             warmup_epochs=5.0, milestones=(0.5, 0.75), interval_epochs=10.0),
    needs_data=True, augment=True,
    models=("resnet8", "resnet14", "resnet20", "resnet18", "vgg-tiny", "vgg11",
            "vgg16", "vgg19"),
)
