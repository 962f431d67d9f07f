"""The run options of sharding: hybrid sharding and plain FSDP2 (fields of
:class:`~gradzip.train.config.RunConfig`, declared here to keep that module small) and the
checks that span them and other options.

Kept apart from :mod:`gradzip.train.hsdp_stepper`, which imports torch's FSDP2 (slow to
import): resolving a configuration never loads it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gradzip._validate import check_bool
from gradzip.train.fields import int_at_least, option

__all__ = ["HSDP", "HSDPFields", "check_hsdp"]

#: The ``gradzip train --help`` section.
HSDP = "sharding (FSDP2)"


@dataclasses.dataclass
class HSDPFields:
    """The sharding options."""

    hsdp: int = option(0, "HSDP: shard the model with FSDP2 inside islands of workers / "
                       "REPLICAS processes and compress the exchange across the REPLICAS "
                       "islands (0: off; 1: plain FSDP2, nothing crosses islands); needs one "
                       "process per worker (--launcher procs or torchrun)", group=HSDP,
                       metavar="REPLICAS", check=int_at_least(0))
    fsdp: bool = option(False, "plain FSDP2: shard the model over all workers and compress "
                        "FSDP2's reduce-scatter through gradzip (error-feedback residuals the "
                        "size of the unsharded model on every rank); needs one process per "
                        "worker", group=HSDP, check=check_bool)


def check_hsdp(cfg: Any) -> None:
    """The checks that span ``hsdp`` and other options (one-line errors), on a resolved
    configuration (its launcher decided, its workers the world size).

    Raises:
        ValueError: ``hsdp`` with simulated workers, not dividing ``workers``, or with an
            option the sharded path does not take; ``fsdp`` with ``hsdp``, simulated
            workers, outer-step training or the batch-size controller.
    """
    if cfg.fsdp:
        _check_fsdp(cfg)
    replicas = cfg.hsdp
    if not replicas:
        return
    if cfg.launcher == "sim":
        raise ValueError(f"`hsdp` needs one process per worker (--launcher procs or torchrun), "
                         f"got launcher='sim' with hsdp={replicas}")
    if cfg.workers % replicas:
        raise ValueError(f"`hsdp` must divide `workers` ({cfg.workers}) into islands of equal "
                         f"size, got {replicas}")
    if cfg.accordion_batch is not None:
        raise ValueError("`accordion_batch` must be unset with `hsdp` (the batch-size controller "
                         f"reads whole averaged gradients, not shards), got {cfg.accordion_batch}")
    if cfg.outer_delay:
        raise ValueError("`outer_delay` must be 0 with `hsdp` (the overlapped outer exchange is "
                         f"not supported on sharded models), got {cfg.outer_delay}")


def _check_fsdp(cfg: Any) -> None:
    if cfg.hsdp:
        raise ValueError(f"`fsdp` must be off with `hsdp` (HSDP shards inside islands; --fsdp "
                         f"shards over every worker), got hsdp={cfg.hsdp}")
    if cfg.launcher == "sim":
        raise ValueError("`fsdp` needs one process per worker (--launcher procs or torchrun), "
                         "got launcher='sim'")
    if cfg.outer_steps:
        raise ValueError("`outer_steps` must be unset with `fsdp` (outer-step training of a "
                         "sharded model runs under --hsdp), got " + str(cfg.outer_steps))
    if cfg.accordion_batch is not None:
        raise ValueError("`accordion_batch` must be unset with `fsdp` (the batch-size controller "
                         f"reads whole averaged gradients, not shards), got {cfg.accordion_batch}")
