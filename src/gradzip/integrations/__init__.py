"""Thin adapters that put gradzip's DDP hook into training frameworks.

Each module imports its framework and is importable only when that framework is installed
(the ``integrations`` extra installs all three); this package itself imports none of them.

* :mod:`gradzip.integrations.lightning`: ``GradzipDDPStrategy`` for ``lightning.Trainer`` and
  ``GradzipFabricDDPStrategy`` for ``lightning.Fabric``.
* :mod:`gradzip.integrations.accelerate`: ``register(accelerator, model, compressor)``.
* :mod:`gradzip.integrations.transformers`: ``GradzipCallback`` for the Hugging Face
  ``Trainer``.

Every adapter registers :func:`gradzip.ddp.register` on the framework's
``DistributedDataParallel`` model (on CPU and GPU alike) and keeps every rank's hook state in
the framework's checkpoints: error-feedback residuals differ per rank, so a checkpoint that
holds rank 0's state only would resume the other ranks wrongly.
"""

__all__: list[str] = []
