"""What FSDP2 hands an all-reduce hook, read once from a ``fully_shard``-ed model.

FSDP2 reduces one *parameter group* (the parameters of one ``fully_shard`` call) at a time:
the group's unsharded gradients are laid out in one flat buffer, reduce-scattered over the
shard dimension, and the all-reduce hook receives this rank's part of the result, a flat
1-D tensor. In it each parameter that had a gradient takes its *padded* shard size (dim 0
rounded up to a multiple of the shard count, divided by it), in the group's parameter
order, and the first elements of that slot hold the parameter's shard (``sharded_size``,
row-major). FSDP then takes the shards' gradients as views of that same tensor, so what the
hook writes into it in place is what the optimizer sees.

This module reads that layout from FSDP2's parameter groups; it is the only module of
:mod:`gradzip.fsdp` that touches FSDP2's private attributes (the hook's argument carries no
names), and it checks they exist so that another torch version fails here, with a message,
and not inside a backward pass.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

__all__ = ["GroupLayout", "ShardSlot", "count_optimizer_step", "fsdp2_differs", "fsdp_groups",
           "one_group_modules", "param_groups", "reduce_every_group", "require_fsdp2_method",
           "same_ranks", "split_mesh"]

log = logging.getLogger("gradzip.fsdp")


@dataclass(frozen=True)
class ShardSlot:
    """One parameter's place in its group's reduce-scatter output on this rank.

    Attributes:
        name: the parameter's name in the model (``model.named_parameters()``).
        shape: this rank's shard of it (FSDP2's ``sharded_size``; may have zero rows when
            there are more shards than rows).
        offset: where the shard starts in the flat output.
        holders: how many shard indices hold a non-empty part of the parameter (all of them
            unless it has fewer rows than there are shards); the same on every rank.
    """

    name: str
    shape: torch.Size
    offset: int
    holders: int = 1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class GroupLayout:
    """One FSDP2 parameter group as the hook sees it.

    Attributes:
        module: the name of the ``fully_shard``-ed module that owns the group (``""``: the root).
        owner: that module (where the hook is installed).
        group: FSDP2's parameter group (read for ``all_reduce_grads`` at every call).
        slots: every trainable parameter of the group, in FSDP2's order.
        numel: the element count of the flat tensor the hook receives.
    """

    module: str
    owner: Any
    group: Any
    slots: tuple[ShardSlot, ...]
    numel: int

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """``name -> this rank's shard of its gradient``, views of ``flat`` (empty shards left
        out: they have nothing to exchange).

        Raises:
            ValueError: ``flat`` is not the 1-D tensor of :attr:`numel` elements the layout
                expects (a parameter's ``requires_grad`` changed after registration).
        """
        if flat.dim() != 1 or flat.numel() != self.numel:
            raise ValueError(
                f"the reduce-scatter output of FSDP module {self.module or '<root>'!r} must be a "
                f"1-D tensor of {self.numel} elements (its trainable parameters when the hook "
                f"was registered), got shape {tuple(flat.shape)}; register again after changing "
                "which parameters require gradients"
            )
        return {s.name: flat.narrow(0, s.offset, s.numel).view(s.shape)
                for s in self.slots if s.numel}

    @property
    def exchanged(self) -> bool:
        """Whether any of the group's shards on this rank is non-empty."""
        return any(s.numel for s in self.slots)


def split_mesh(mesh: Any, replicate_dim: str, shard_dim: str) -> tuple[DeviceMesh, DeviceMesh]:
    """The replicate and shard submeshes of a 2-D mesh.

    Args:
        mesh: a 2-D :class:`~torch.distributed.device_mesh.DeviceMesh`.
        replicate_dim: the name of its replica dimension (the exchange gradzip compresses).
        shard_dim: the name of its shard dimension (FSDP2's reduce-scatter).

    Returns:
        ``(replicate_mesh, shard_mesh)``, both 1-D.

    Raises:
        TypeError: ``mesh`` is not a DeviceMesh.
        ValueError: ``mesh`` is not 2-D or lacks one of the two names.
    """
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"`mesh` must be a torch.distributed.device_mesh.DeviceMesh, "
                        f"got {type(mesh).__name__}")
    for label, value in (("replicate_dim", replicate_dim), ("shard_dim", shard_dim)):
        if not isinstance(value, str) or not value:
            raise TypeError(f"`{label}` must be a non-empty string, got {value!r}")
    if replicate_dim == shard_dim:
        raise ValueError(f"`replicate_dim` and `shard_dim` must differ, got {shard_dim!r} twice")
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2:
        raise ValueError(
            f"`mesh` must be 2-D (replicate x shard), got a {mesh.ndim}-D mesh of shape "
            f"{tuple(mesh.shape)}; a 1-D mesh has no replica dimension to compress across "
            "(use a (1, N) mesh for plain FSDP2 with compression state, or gradzip.ddp for DDP)"
        )
    if replicate_dim not in names or shard_dim not in names:
        raise ValueError(
            f"`mesh` must name its dimensions {replicate_dim!r} and {shard_dim!r} (or pass "
            f"replicate_dim= and shard_dim=), got mesh_dim_names={names or None}"
        )
    return mesh[replicate_dim], mesh[shard_dim]


def param_groups(module: FSDPModule) -> list[Any]:
    """FSDP2's parameter groups of one ``fully_shard``-ed module (one per mesh)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch releases with one group per state
        single = getattr(state, "_fsdp_param_group", None)
        groups = [] if single is None else [single]
    return list(groups)


def _holders(fsdp_param: Any, shards: int) -> int:
    """How many shard indices hold a non-empty part of the parameter: FSDP2 splits its shard
    dimension as ``torch.chunk`` does (chunks of ``ceil(n / shards)``, the last ones empty
    when ``n`` is small), from the global shape, so every rank computes the same number."""
    size = fsdp_param.sharded_param.shape[fsdp_param.fsdp_placement.dim]
    if size == 0:
        return 0
    return math.ceil(size / math.ceil(size / shards))


def same_ranks(a: DeviceMesh, b: DeviceMesh) -> bool:
    """Whether two meshes have the same shape and ranks."""
    return a.ndim == b.ndim and a.mesh.tolist() == b.mesh.tolist()


def one_group_modules(model: nn.Module, mesh: DeviceMesh, *, mesh_name: str, call: str,
                      sharding: str) -> Iterator[tuple[str, nn.Module, str, Any]]:
    """Every ``fully_shard``-ed module of ``model`` with its one parameter group, checked to be
    sharded on the 1-D ``mesh``: ``(module_name, module, where, group)``, ``where`` the name
    errors use.

    Args:
        model: the root module.
        mesh: the 1-D mesh every group must be sharded on.
        mesh_name: how errors name ``mesh``; ``call``: the ``fully_shard`` argument errors
            suggest for the root; ``sharding``: the fix errors suggest for a module sharded
            elsewhere.

    Raises:
        TypeError: ``model`` is not ``fully_shard``-ed.
        ValueError: a module with several parameter groups, or sharded on another mesh.
    """
    if not isinstance(model, FSDPModule):
        raise TypeError(
            f"`model` must be fully_shard-ed (a torch.distributed.fsdp.FSDPModule), got "
            f"{type(model).__name__}; call fully_shard(model, {call}) first"
        )
    for module_name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = param_groups(module)
        where = module_name or "<root>"
        if len(groups) > 1:
            raise ValueError(
                f"FSDP module {where!r} has {len(groups)} parameter groups (a per-parameter "
                "mesh); gradzip needs one group per fully_shard call"
            )
        for group in groups:
            sharded_on = group.mesh_info.mesh
            if sharded_on.ndim != 1 or not same_ranks(sharded_on, mesh):
                raise ValueError(
                    f"FSDP module {where!r} is sharded on a {sharded_on.ndim}-D mesh of shape "
                    f"{tuple(sharded_on.shape)}, not on {mesh_name} (shape "
                    f"{tuple(mesh.shape)}); shard it with {sharding}"
                )
            yield module_name, module, where, group


def fsdp2_differs(reader: str, exc: AttributeError) -> RuntimeError:
    """The error for FSDP2 internals that this torch lacks (``exc``), naming what read them."""
    return RuntimeError(f"{reader} reads FSDP2's parameter groups (tested on torch 2.13); this "
                        f"torch ({torch.__version__}) differs: {exc}")


def count_optimizer_step(ref: Any) -> None:
    """An optimizer step post-hook's work for either adapter's state (held weakly by ``ref``):
    count the step, where the state counts them."""
    state = ref()
    if state is not None and state._optimizer_steps is not None:
        state._optimizer_steps += 1


def fsdp_groups(model: nn.Module, shard_mesh: DeviceMesh) -> list[GroupLayout]:
    """:func:`_fsdp_groups`, with FSDP2 internals that this torch lacks reported as such."""
    try:
        return _fsdp_groups(model, shard_mesh)
    except AttributeError as exc:
        raise fsdp2_differs("gradzip.fsdp", exc) from exc


def _fsdp_groups(model: nn.Module, shard_mesh: DeviceMesh) -> list[GroupLayout]:
    """Every FSDP2 parameter group of ``model`` with its trainable parameters' shard slots.

    Args:
        model: the root module, ``fully_shard``-ed (its submodules may be too).
        shard_mesh: the 1-D mesh the model must be sharded on.

    Returns:
        The groups in module order (groups without a trainable parameter left out).

    Raises:
        TypeError: ``model`` is not ``fully_shard``-ed.
        RuntimeError: this torch's FSDP2 lacks an attribute read here.
        ValueError: a module sharded on another mesh (the 2-D mesh itself included: native
            HSDP runs its own all-reduce first), one with several parameter groups, or one
            that already has an all-reduce hook.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    out: list[GroupLayout] = []
    sharding = "fully_shard(module, mesh=mesh['shard']) and pass the 2-D mesh here (native "
    for module_name, module, where, group in one_group_modules(
            model, shard_mesh, mesh_name="mesh[shard_dim]", call="mesh=mesh['shard']",
            sharding=sharding + "HSDP on the 2-D mesh all-reduces before any hook runs)"):
        if getattr(group, "_all_reduce_hook", None) is not None:
            raise ValueError(
                f"FSDP module {where!r} already has an all-reduce hook (was gradzip.fsdp."
                "register called twice? call .remove() on the first state)"
            )
        slots, offset = [], 0
        for fsdp_param in group.fsdp_params:
            param = fsdp_param.sharded_param
            if not param.requires_grad:
                continue
            slots.append(ShardSlot(names[id(param)], torch.Size(fsdp_param.sharded_size),
                                   offset, _holders(fsdp_param, shard_mesh.size())))
            offset += math.prod(fsdp_param.padded_sharded_param_size)
        if slots:
            out.append(GroupLayout(module_name, module, group, tuple(slots), offset))
    return out


def reduce_every_group(owners: Iterable[Any]) -> bool:
    """Ask FSDP2 to reduce each of ``owners``' parameter groups in every backward, a zero
    gradient standing in for a parameter that took none (``set_reduce_scatter_unused_params``).

    Why: gradzip's engine finishes a step when every group has been exchanged, so a group
    FSDP2 leaves out of a backward would leave the step open. PyTorch releases without that
    method (2.11 has none) reduce a group only where its parameters took a gradient: there
    every parameter must take one in every backward (as FSDP2 itself then needs wherever
    ranks would differ), and gradzip still runs, saying so once in the log.

    Returns:
        Whether FSDP2 has the method (it was turned on for every group).
    """
    owners = list(owners)
    if not all(hasattr(o, "set_reduce_scatter_unused_params") for o in owners):
        log.warning("this PyTorch's FSDP2 has no set_reduce_scatter_unused_params: every "
                    "parameter must receive a gradient in every backward")
        return False
    for owner in owners:
        owner.set_reduce_scatter_unused_params(True, recurse=False)
    return True


def require_fsdp2_method(owners: Iterable[Any], name: str, what: str) -> None:
    """Refuse, in one line, a PyTorch whose FSDP2 lacks the method ``name`` gradzip plugs into.

    Raises:
        RuntimeError: one of ``owners`` has no ``name``.
    """
    if not all(hasattr(owner, name) for owner in owners):
        raise RuntimeError(f"{what} needs FSDP2's FSDPModule.{name}, which this PyTorch "
                           f"({torch.__version__}) does not have")
