"""FSDP2 with a compressed gradient exchange: across replicas (HSDP), or the reduce-scatter.

Two modes:

* :func:`register`: HSDP, ``fully_shard`` on a 2-D mesh (below); the exchange across
  replicas is compressed, residuals are shard-sized.
* :func:`register_reduce_scatter`: plain FSDP2 on a 1-D mesh; the reduce-scatter itself is
  compressed (see :mod:`gradzip.fsdp.scatter`), residuals are the unsharded gradients' size.

Hybrid sharding shards a model inside an island (a node, a rack) and replicates it across
islands; the exchange across islands is the slow one. gradzip plugs into FSDP2 at its
all-reduce hook:

* the model is ``fully_shard``-ed on the **shard** submesh only (``mesh["shard"]``), so
  FSDP2's reduce-scatter averages each group's gradients inside the island and runs no
  all-reduce of its own;
* each group's all-reduce hook receives this rank's shard of the island's mean, a flat
  tensor (see :mod:`gradzip.fsdp.groups`), and averages it over the **replicate** submesh
  through one :class:`~gradzip.Engine` per rank, in place; FSDP2 then takes the shards'
  gradients as views of it.

The engine's tensors are the shards, named by parameter with their shard-local shapes, so
residuals and compressor state are the size of a shard, and a checkpoint is keyed by
parameter name. The mean of the island means is the global mean, as native HSDP computes it.

Usage::

    mesh = init_device_mesh("cuda", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    state = gradzip.fsdp.register(model, "powersgd:rank=4", mesh=mesh)
"""

from gradzip.fsdp.dcp import DCPEntry
from gradzip.fsdp.groups import GroupLayout, ShardSlot
from gradzip.fsdp.scatter import FSDPScatterState, register_reduce_scatter
from gradzip.fsdp.state import FSDPHookState, register
from gradzip.fsdp.unsharded import UnshardedLayout, UnshardedSlot

__all__ = ["DCPEntry", "FSDPHookState", "FSDPScatterState", "GroupLayout", "ShardSlot",
           "UnshardedLayout", "UnshardedSlot", "register", "register_reduce_scatter"]
