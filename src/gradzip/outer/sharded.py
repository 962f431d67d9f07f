"""Outer-step training of FSDP2/HSDP models: anchors, outer state and residuals per shard.

An island (the shard dimension of a replicate x shard mesh) trains one copy of the model,
``fully_shard``-ed on ``mesh[shard_dim]``: its inner steps reduce-scatter gradients inside
the island only. Every ``H`` inner steps, :class:`ShardedOuter` takes each rank's
pseudo-gradient *of its own shards* (``anchor shard - parameter shard``) and averages it
across the **replicate** dimension through one :class:`~gradzip.Engine` per rank, whose
collective is this rank's replica group (the ranks holding the same shard index in every
island). The shard dimension holds different data and carries no part of the exchange.

Everything the outer loop keeps is therefore the size of this rank's shards: the anchor, the
outer optimizer's momentum and the error-feedback residuals. The outer step is element-wise,
so with an element-wise compressor (``none``, ``fp16``, ``bf16``) the sharded run is the
unsharded run cut into shards; compressors whose message depends on a whole tensor (top-k,
PowerSGD, QSGD's norm) see each shard as its own tensor, exactly as the simulator does when
fed the same shards.

This module imports torch's FSDP2 (slow to import), so ``gradzip.outer`` does not load it:
``gradzip.ShardedOuter`` does, on first use.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradzip.comm import ProcessGroupCollective
from gradzip.compressors.base import Compressor
from gradzip.fsdp.groups import fsdp_groups, split_mesh
from gradzip.outer.fragments import split_fragments
from gradzip.outer.outer import Outer

__all__ = ["ShardedOuter"]


class _LocalShards(Mapping[str, list[torch.Tensor]]):
    """``name -> [this rank's shard of the parameter]``, what :class:`Outer` reads as one
    local worker's tensors.

    Read afresh at every access (``to_local()`` is a view of the parameter's storage, so
    writing into it under ``no_grad`` moves the parameter): FSDP2 may give a sharded
    parameter a new local tensor (its lazy initialisation resets them), and a view kept from
    before would then write into storage the model no longer uses.
    """

    def __init__(self, params: Mapping[str, Any]) -> None:
        self._params = dict(params)

    def __getitem__(self, name: str) -> list[torch.Tensor]:
        return [self._params[name].to_local()]

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


class ShardedOuter(Outer):
    """:class:`~gradzip.Outer` for a model ``fully_shard``-ed inside each island of a 2-D
    (replicate x shard) mesh: outer-step training where every piece of outer state is the
    size of this rank's shards.

    Call it on every rank, after ``fully_shard(module, mesh=mesh[shard_dim])`` on the model
    and its submodules, and :meth:`step` after every inner optimizer step, as with
    :class:`~gradzip.Outer`. The inner steps stay FSDP2's (the reduce-scatter averages over
    the island); no gradient crosses the replicate dimension. Every ``H`` inner steps (per
    fragment) this rank's pseudo-gradient shards are compressed with error feedback and
    averaged over its replica group, the outer optimizer moves its anchor shards, and its
    parameter shards take the new anchor.

    A ``(1, S)`` mesh is plain FSDP2 with one replica (nothing is exchanged, the outer
    optimizer still steps); an ``(R, 1)`` mesh is DDP-style outer training through FSDP2.

    Args:
        model: the root module, ``fully_shard``-ed on ``mesh[shard_dim]`` (its submodules
            too, where they are), on every rank from the same initial parameters.
        compressor: any compressor spec, :class:`~gradzip.Compressor` or controller; it sees
            this rank's shards (named by parameter, with their shard-local shapes).
        mesh: the 2-D :class:`~torch.distributed.device_mesh.DeviceMesh`, replicate x shard.
        inner_steps: ``H``, as for :class:`~gradzip.Outer`.
        replicate_dim: the name of the replica dimension of ``mesh`` (default
            ``"replicate"``): the exchange runs across it.
        shard_dim: the name of the shard dimension of ``mesh`` (default ``"shard"``).
        **outer_options: every other keyword of :class:`~gradzip.Outer` (``outer_optimizer``,
            ``fragments``, ``delay``, ``alpha``, ``offload``, ``overlap``,
            ``inner_optimizers``, the engine's options), except ``collective``: the exchange
            runs on the replicate dimension's group.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised, or this torch's FSDP2 lacks
            what :mod:`gradzip.fsdp` reads.
        TypeError, ValueError: invalid arguments, naming the parameter; a model not
            ``fully_shard``-ed on ``mesh[shard_dim]`` (natively HSDP-sharded on the 2-D mesh
            included: it would all-reduce every inner step across replicas), a mesh that is
            not 2-D or lacks the two names, a ``collective``, or a fragment that leaves a
            shard index without any of its tensors.

    Example:
        >>> mesh = init_device_mesh("cuda", (2, 8), mesh_dim_names=("replicate", "shard"))
        >>> fully_shard(model, mesh=mesh["shard"])
        >>> outer = gradzip.ShardedOuter(model, "topk:ratio=0.01", mesh=mesh, inner_steps=100)
    """

    def __init__(
        self,
        model: nn.Module,
        compressor: Compressor | str = "none",
        *,
        mesh: Any,
        inner_steps: int,
        replicate_dim: str = "replicate",
        shard_dim: str = "shard",
        **outer_options: Any,
    ) -> None:
        if "collective" in outer_options:
            raise TypeError("`collective` is not taken by ShardedOuter: the exchange runs on "
                            f"mesh[{replicate_dim!r}]'s process group, got collective="
                            f"{type(outer_options['collective']).__name__}")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("ShardedOuter needs an initialised torch.distributed process group")
        if isinstance(model, Sequence) or not isinstance(model, nn.Module):
            raise TypeError(f"`model` must be this rank's fully_shard-ed module, got {type(model).__name__}")
        replicate_mesh, shard_mesh = split_mesh(mesh, replicate_dim, shard_dim)
        groups = fsdp_groups(model, shard_mesh)
        holders = {s.name: s.holders for g in groups for s in g.slots}
        self.replicas = replicate_mesh.size()
        self.shards = shard_mesh.size()
        self.shard_rank = shard_mesh.get_local_rank()
        self.replica_rank = replicate_mesh.get_local_rank()
        self.shard_group = shard_mesh.get_group()
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        unsharded = sorted(set(trainable) - set(holders))
        if unsharded:
            raise ValueError(f"`model`'s trainable parameters must all be managed by fully_shard, "
                             f"got {unsharded[:3]} outside every FSDP module")
        #: Every trainable parameter's name, in the model's order (the same on every rank).
        self.all_names = list(trainable)
        fragments = outer_options.get("fragments", 1)
        if isinstance(fragments, int) and not isinstance(fragments, bool) and fragments >= 1:
            # Decided from global shapes, so every rank refuses together (a rank raising alone
            # would leave the others waiting in the configuration check).
            for f, names in enumerate(split_fragments(self.all_names, fragments)):
                held = max(holders[n] for n in names)
                if held < self.shards:
                    raise ValueError(
                        f"`model` must give every one of the {self.shards} shards a non-empty "
                        f"part of some tensor of every fragment, got fragment {f} held by "
                        f"{held} shards (too few rows for this many shards; use fewer "
                        "`fragments` or shards)")
        self._shards = {n: p for n, p in trainable.items() if p.to_local().numel()}
        device = next(iter(trainable.values())).device
        # Collectives run where the shards live (NCCL cannot reduce CPU tensors).
        collective = ProcessGroupCollective(
            replicate_mesh.get_group(), device=None if device.type == "cpu" else device)
        super().__init__(model, compressor, inner_steps=inner_steps, collective=collective,
                         **outer_options)

    # -- what Outer reads --------------------------------------------------------------------
    def _parameters(self) -> dict[str, list[torch.Tensor]]:
        """This rank's non-empty shards (a parameter with fewer rows than shards leaves the
        last shard indices empty: nothing to keep or exchange there)."""
        return _LocalShards(self._shards)  # type: ignore[return-value]

    def _split_fragments(self) -> list[tuple[str, ...]]:
        """The unsharded model's fragments (split over every trainable name, identical on
        every rank), each restricted to this rank's non-empty shards: the same tensors
        synchronise together as without sharding."""
        local = set(self.names)
        return [tuple(n for n in names if n in local)
                for names in split_fragments(self.all_names, self.plan.fragments)]

    def _deltas(self, fragment: int) -> dict[str, torch.Tensor]:
        deltas = super()._deltas(fragment)
        if self.shards > 1:
            self._agree_on_nonfinite(deltas)
        return deltas

    def _agree_on_nonfinite(self, deltas: dict[str, torch.Tensor]) -> None:
        """Make a non-finite pseudo-gradient on any rank of this island visible to this rank's
        engine.

        Why: a NaN in one rank's shard reaches that shard's replica group only, so the other
        shard indices' replica groups would apply the synchronisation while it skips (or
        raises): the island's ranks would then hold parts of different models. A 0-d flag,
        all-reduced (max) over the shard group, says whether any shard of the island is
        non-finite; where it is, this rank writes a NaN into the first element of its
        fragment's first tensor (a fresh tensor, not a parameter), so every replica group's
        engine takes the policy in the same synchronisation, on every rank of the mesh. Every
        rank calls this at the same inner step (the plan is global) and every fragment holds a
        non-empty tensor on every rank (checked at construction), so the all-reduce always has
        all its members.
        """
        bad = torch.zeros((), dtype=torch.float32, device=self.device)
        for delta in deltas.values():
            bad = torch.maximum(bad, (~torch.isfinite(delta)).any().to(torch.float32))
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.shard_group)
        first = next(iter(deltas.values())).view(-1)[:1]
        first.copy_(torch.where(bad > 0, torch.full_like(first, float("nan")), first))

    # -- agreement, observability ------------------------------------------------------------
    def checkpoint_config(self) -> dict[str, str]:
        """:meth:`Outer.checkpoint_config` plus the mesh shape and this rank's shard index: a
        checkpoint loads only on the rank of the same shard of the same mesh (the members of
        a replica group, which compare this, share both)."""
        return {**super().checkpoint_config(), "mesh": f"{self.replicas}x{self.shards}",
                "shard_rank": str(self.shard_rank)}

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds: ``anchor``, ``outer_state`` (the outer momentum) and
        ``residuals`` (error feedback), each the size of this rank's shards."""
        def size(tensors: Mapping[str, torch.Tensor]) -> int:
            return sum(t.numel() * t.element_size() for t in tensors.values())
        return {"anchor": size(self.anchor), "outer_state": size(self.outer_state),
                "residuals": size(self.engine.residuals)}

    def __repr__(self) -> str:
        return (f"ShardedOuter(compressor={self.engine.compressor.spec()!r}, "
                f"replicas={self.replicas}, shards={self.shards}, tensors={len(self.names)})")
