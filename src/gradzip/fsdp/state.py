"""The state behind gradzip's FSDP2 all-reduce hooks: one engine over the replica dimension.

See :mod:`gradzip.fsdp` for the design; :func:`register` installs it on a model.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradzip.comm.torch_dist import ProcessGroupCollective
from gradzip.compressors.base import Compressor
from gradzip.ddp.params import tree_to
from gradzip.engine import STATS_KEYS, Engine
from gradzip.fsdp.groups import (
    GroupLayout,
    count_optimizer_step,
    fsdp_groups,
    reduce_every_group,
    require_fsdp2_method,
    split_mesh,
)
from gradzip.options import EngineOptions

__all__ = ["FSDPHookState", "register"]

log = logging.getLogger("gradzip.fsdp")

_FORMAT = "gradzip.fsdp/1"


class FSDPHookState:
    """Compressed cross-replica exchange of a ``fully_shard``-ed model's gradient shards.

    Built by :func:`register`. One :class:`~gradzip.Engine` per rank runs over the replicate
    dimension's process group: its tensors are this rank's shards (named by parameter, with
    their shard-local shapes), so its residuals and compressor state are shard-sized.

    Args:
        model: the root module, ``fully_shard``-ed on ``mesh[shard_dim]``.
        compressor: a :class:`~gradzip.Compressor` (an Accordion included) or a spec string.
        mesh: the 2-D device mesh, replicate x shard.
        replicate_dim: the name of the replica dimension in ``mesh``.
        shard_dim: the name of the shard dimension in ``mesh``.
        options: an :class:`~gradzip.EngineOptions` (its fields may also be given as keywords,
            which replace the record's).
        **engine_options: fields of :class:`~gradzip.EngineOptions` as keywords.

    Raises:
        TypeError, ValueError: invalid arguments or a model/mesh this adapter does not
            support, naming the parameter.
    """

    def __init__(
        self,
        model: nn.Module,
        compressor: Compressor | str,
        *,
        mesh: Any,
        replicate_dim: str = "replicate",
        shard_dim: str = "shard",
        options: EngineOptions | None = None,
        **engine_options: Any,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("gradzip.fsdp needs an initialised torch.distributed process group")
        replicate_mesh, shard_mesh = split_mesh(mesh, replicate_dim, shard_dim)
        self.groups: list[GroupLayout] = fsdp_groups(model, shard_mesh)
        #: name -> this rank's shard shape (the engine's tensors; empty shards left out).
        self.shapes: dict[str, torch.Size] = {
            s.name: s.shape for g in self.groups for s in g.slots if s.numel
        }
        self.replicas = replicate_mesh.size()
        self.shards = shard_mesh.size()
        # Decided from global shapes, so every rank refuses together (a rank that raised
        # alone would leave the others waiting in their first collective).
        holders = max((s.holders for g in self.groups for s in g.slots), default=0)
        if holders < self.shards:
            raise ValueError(
                f"`model` must give every one of the {self.shards} shards a non-empty part of "
                f"some trainable parameter, got {holders} shards holding any (too few rows "
                "for this many shards)"
            )
        assert self.shapes
        self.shard_rank = shard_mesh.get_local_rank()
        self.replica_rank = replicate_mesh.get_local_rank()
        self.shard_group = shard_mesh.get_group()
        device = next(iter(model.parameters())).device
        # Collectives run where the shards live (NCCL cannot reduce CPU tensors).
        collective = ProcessGroupCollective(
            replicate_mesh.get_group(), device=None if device.type == "cpu" else device
        )
        self.engine = Engine(self.shapes, compressor, collective=collective,
                             options=EngineOptions.build(options, **engine_options))
        self.compressor = self.engine.compressor
        self.device = device
        # The groups that hand the engine a tensor. Why the same on every rank of a replica
        # group: its members hold the same shard index of the same model, so the same shard
        # shapes; FSDP2 reduces each such group once per backward (unused parameters
        # included, see register), so the count closes the engine's step.
        self._active = [g for g in self.groups if g.exchanged]
        self._calls = 0
        # Per group: the reduce-scatter outputs of backward passes that FSDP2 was told not to
        # all-reduce (``set_requires_all_reduce(False)``), summed until one that is.
        self._partial: dict[int, torch.Tensor] = {}
        self._modules: list[Any] = []
        # Optimizer steps taken since registration, carried in every call's header (None: no
        # optimizer given). Why: the engine's own count advances with every backward on every
        # rank alike, so a replica that runs one backward more than the others (a retried
        # batch) and one fewer later stays "in step" by it while its parameters drift; its
        # count of optimizer steps differs, and the header catches it on every rank.
        self._optimizer_steps: int | None = None
        optimizer = self.engine.optimizer
        if optimizer is not None:
            self._optimizer_steps = 0
            while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
                optimizer = optimizer.optimizer  # a wrapper steps the optimizer it holds
            ref = weakref.ref(self)
            optimizer.register_step_post_hook(lambda *_: count_optimizer_step(ref))

    # -- the hook ------------------------------------------------------------------------------
    def hook_for(self, index: int) -> Any:
        """The all-reduce hook of :attr:`groups` ``[index]`` (what :func:`register` installs)."""
        layout = self.groups[index]

        def hook(flat: torch.Tensor) -> None:
            self.exchange(layout, flat)

        return hook

    def exchange(self, layout: GroupLayout, flat: torch.Tensor) -> None:
        """Average one group's reduce-scatter output over the replicas, in place.

        Args:
            layout: one of :attr:`groups`.
            flat: the group's reduce-scatter output on this rank (the shard-group mean).

        Raises:
            ValueError: ``flat`` does not have the layout's size.
            FloatingPointError: a non-finite gradient anywhere in the mesh with
                ``nonfinite="raise"`` (on every rank).
            RuntimeError: replicas out of step (on every rank).
        """
        named = layout.views(flat)
        key = id(layout)
        if not layout.group.all_reduce_grads:
            # Gradient accumulation without the cross-replica exchange: keep this backward's
            # shard mean aside and hand FSDP2 zeros (it adds them to .grad), as native HSDP
            # keeps its partial reduce-scatter output; the exchange of the sum comes with the
            # next backward that all-reduces.
            kept = self._partial.get(key)
            self._partial[key] = flat.clone() if kept is None else kept.add_(flat)
            flat.zero_()
            return
        kept = self._partial.pop(key, None)
        if kept is not None:
            flat.add_(kept)
        if self.shards > 1:
            # Every rank of the island, its shards of this group empty or not: the flag's
            # all-reduce spans the shard group (every group here has a trainable parameter).
            self._agree_on_nonfinite(named)
        if not named:
            return  # every member of this replica group has the same empty shards
        # Left at 0 if the engine raises: it rolled its step back.
        calls, self._calls = self._calls + 1, 0
        finish = calls == len(self._active)
        # FSDP2 reduces the groups in the same order on every rank, with the same shard shapes
        # across a replica group: the payload's layout is identical on its members, so the
        # header may ride in it (reduce_bucket's same_layout).
        self.engine.reduce_bucket(self.engine.bucket_layout(named, flat), finish_step=finish,
                                  step=self._optimizer_steps)
        self._calls = 0 if finish else calls

    def _agree_on_nonfinite(self, named: Mapping[str, torch.Tensor]) -> None:
        """Make a non-finite value on any rank of this island visible to this rank's engine.

        Why: the reduce-scatter puts a NaN of one rank's gradient into one shard only, so only
        that shard's replica group would see it, and the other shards' replica groups would
        step while it skips (or raises). A 0-d flag, all-reduced (max) over the shard group,
        says whether any shard of the island is non-finite; where it is, this rank writes a
        NaN into the first element of its first shard, so every replica group's engine sees
        a non-finite gradient in the same call and takes the policy, on every rank of the
        mesh. Nothing is read on the host; a finite step keeps its bits.
        """
        bad = torch.zeros((), dtype=torch.float32, device=self.device)
        for view in named.values():
            bad = torch.maximum(bad, (~torch.isfinite(view)).any().to(torch.float32))
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.shard_group)
        if not named:
            return
        first = next(iter(named.values())).view(-1)[:1]
        first.copy_(torch.where(bad > 0, torch.full_like(first, float("nan")), first))

    # -- observability ---------------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, Any]:
        """This rank's cumulative counters (the engine's, over the replica dimension, as plain
        ints), plus ``compression_rate`` (dense wire bytes / wire bytes, ``None`` before any
        byte is sent)."""
        raw = self.engine.stats
        out: dict[str, Any] = {
            key: (value[0] if isinstance(value, list) else value) for key, value in raw.items()
        }
        assert tuple(raw) == STATS_KEYS
        out["compression_rate"] = (
            out["dense_wire_bytes"] / out["wire_bytes"] if out["wire_bytes"] else None
        )
        return out

    def residual_bytes(self) -> int:
        """Bytes of error-feedback residuals this rank holds (shard-sized)."""
        return sum(r.numel() * r.element_size() for r in self.engine.residuals.values())

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state (tensors and plain values): save one file per rank.

        Raises:
            RuntimeError: called inside a step (between two groups' reductions).
        """
        if self._calls or self._partial:
            raise RuntimeError(
                "state_dict() must be called between optimizer steps, not inside a backward "
                "pass or between accumulation steps that skip the all-reduce"
            )
        return {
            "format": _FORMAT,
            "replicas": self.replicas,
            "shards": self.shards,
            "shard_rank": self.shard_rank,
            "engine": self.engine.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output of the same rank of the same mesh shape.

        Raises:
            TypeError: ``state`` is not a mapping.
            ValueError: another format, mesh shape or shard rank, or what
                :meth:`Engine.load_state_dict <gradzip.Engine.load_state_dict>` refuses.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"`state` must be a mapping, got {type(state).__name__}")
        if state.get("format") != _FORMAT:
            raise ValueError(f"`state['format']` must be {_FORMAT!r}, got {state.get('format')!r}")
        for key in ("replicas", "shards", "shard_rank"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"`state['{key}']` must be {getattr(self, key)} (this rank's mesh), got "
                    f"{state.get(key)!r}: load each rank's own file on a mesh of the same shape"
                )
        if "engine" not in state:
            raise ValueError("`state` must hold the key 'engine'")
        self.engine.load_state_dict(tree_to(state["engine"], self.device))
        self._calls = 0
        self._partial.clear()

    def save(self, folder: str | os.PathLike[str]) -> Path:
        """Write :meth:`state_dict` to this rank's file in ``folder`` (e.g. the folder a
        ``torch.distributed.checkpoint`` save just wrote), CPU tensors, atomically.

        Args:
            folder: an existing folder, shared by the ranks or local to each.

        Returns:
            The file written: ``folder / "gradzip-fsdp-rank{rank:05d}.pt"`` (the global rank).

        Raises:
            TypeError: ``folder`` is not a path.
            FileNotFoundError: ``folder`` does not exist.
        """
        path = self._file(folder)
        if not path.parent.is_dir():
            raise FileNotFoundError(f"`folder` must be an existing folder, got {str(path.parent)!r}")
        partial = path.with_suffix(".pt.partial")
        torch.save(tree_to(self.state_dict(), torch.device("cpu")), partial)
        os.replace(partial, path)
        return path

    def load(self, folder: str | os.PathLike[str]) -> None:
        """Read this rank's file written by :meth:`save` and :meth:`load_state_dict` it.

        Raises:
            TypeError: ``folder`` is not a path.
            FileNotFoundError: this rank's file is missing.
            ValueError: what :meth:`load_state_dict` refuses.
        """
        path = self._file(folder)
        if not path.is_file():
            raise FileNotFoundError(f"no gradzip FSDP state for this rank: {str(path)!r}")
        self.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))

    @staticmethod
    def _file(folder: str | os.PathLike[str]) -> Path:
        if not isinstance(folder, (str, os.PathLike)):
            raise TypeError(f"`folder` must be a path, got {type(folder).__name__}")
        return Path(folder) / f"gradzip-fsdp-rank{dist.get_rank():05d}.pt"

    def remove(self) -> None:
        """Take the hooks off the model (FSDP2's own reduction applies again; no replica
        exchange happens then, so re-register or shard on the 2-D mesh)."""
        for module in self._modules:
            module.set_all_reduce_hook(None)  # type: ignore[arg-type]
        self._modules = []

    def __repr__(self) -> str:
        return (f"FSDPHookState(compressor={self.compressor.spec()!r}, replicas={self.replicas}, "
                f"shards={self.shards}, parameters={len(self.shapes)})")


def register(
    model: nn.Module,
    compressor: Compressor | str,
    *,
    mesh: Any,
    replicate_dim: str = "replicate",
    shard_dim: str = "shard",
    options: EngineOptions | None = None,
    **engine_options: Any,
) -> FSDPHookState:
    """Compress the cross-replica gradient exchange of an HSDP model through gradzip.

    Call once, after ``fully_shard(module, mesh=mesh[shard_dim])`` on the model and its
    submodules and before the first backward. The reduce-scatter inside each replica stays
    FSDP2's; each group's all-reduce hook then averages this rank's shard over the replicas
    through one :class:`~gradzip.Engine`. Turns on FSDP2's
    ``set_reduce_scatter_unused_params(True)`` so that every group is reduced every step with
    the same layout (unused parameters take zero gradients, as under DDP); on a PyTorch
    without it every parameter must take a gradient in every backward (logged once).

    Args:
        model: the root module, ``fully_shard``-ed on ``mesh[shard_dim]``.
        compressor: a :class:`~gradzip.Compressor` or spec string such as ``"powersgd:rank=2"``.
        mesh: the 2-D :class:`~torch.distributed.device_mesh.DeviceMesh` (replicate x shard).
        replicate_dim: the name of the replica dimension (default ``"replicate"``).
        shard_dim: the name of the shard dimension (default ``"shard"``).
        options: an :class:`~gradzip.EngineOptions` record.
        **engine_options: fields of :class:`~gradzip.EngineOptions` as keywords.

    Returns:
        The :class:`FSDPHookState`: ``stats``, ``residual_bytes()``, ``state_dict()`` (one file
        per rank), ``load_state_dict()``, ``remove()``.

    Raises:
        TypeError, ValueError: invalid arguments, a model not ``fully_shard``-ed on
            ``mesh[shard_dim]``, a 1-D mesh or one without the two dimension names, a module
            that already has an all-reduce hook (registered twice).
        RuntimeError: ``torch.distributed`` is not initialised, or this PyTorch's FSDP2 has
            no ``set_all_reduce_hook``.
    """
    state = FSDPHookState(model, compressor, mesh=mesh, replicate_dim=replicate_dim,
                          shard_dim=shard_dim, options=options, **engine_options)
    require_fsdp2_method((layout.owner for layout in state.groups), "set_all_reduce_hook",
                         "gradzip.fsdp.register")
    reduce_every_group(layout.owner for layout in state.groups)
    for index, layout in enumerate(state.groups):
        layout.owner.set_all_reduce_hook(state.hook_for(index))
        state._modules.append(layout.owner)
    log.debug("registered gradzip %s on %d shards (%d x %d mesh)", state.compressor.spec(),
              len(state.shapes), state.replicas, state.shards)
    return state
