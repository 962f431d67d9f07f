"""What FSDP2 hands a custom reduce-scatter, read once from a ``fully_shard``-ed model.

FSDP2 reduces one parameter group (the parameters of one ``fully_shard`` call) at a time. Its
reduce-scatter input is one flat buffer of ``W`` equal rows, one per rank of the shard
dimension (``W`` ranks): row ``r`` holds, for every parameter that has a gradient in the
group's order, rows ``[r * c, (r + 1) * c)`` of its unsharded gradient, where ``c`` is
``ceil(dim0 / W)`` and rows past the parameter's end are zero padding. The output is this
rank's row of the reduced buffer: the same slots, which FSDP2 then views as the shards'
gradients.

:class:`UnshardedLayout` maps that buffer to each parameter's whole gradient (its own shape,
named by parameter, no padding) and back to this rank's row: what the engine exchanges in the
compressed reduce-scatter of :mod:`gradzip.fsdp.scatter`.

With :mod:`gradzip.fsdp.groups`, this is the only module that touches FSDP2's private parts
(its reduce-scatter interface, which ``torch.distributed.fsdp`` does not export, and its
parameter groups); another torch version fails here, at registration, with a message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from gradzip.fsdp.groups import fsdp2_differs, one_group_modules

try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
except ImportError:  # another torch: unsharded_layouts says so, at registration
    ReduceScatter = object  # type: ignore[assignment,misc]
    DefaultReduceScatter = None  # type: ignore[assignment,misc]

__all__ = ["ReduceScatter", "UnshardedLayout", "UnshardedSlot", "default_reduce_scatter",
           "unsharded_layout", "unsharded_layouts"]


@dataclass(frozen=True)
class UnshardedSlot:
    """One parameter's place in its group's reduce-scatter input and output.

    Attributes:
        name: the parameter's name in the model.
        shape: its unsharded (global) shape.
        rows: ``c``, the rows of it each rank's slot holds (padding included).
        offset: where the slot starts in a row of the input (and in the output).
    """

    name: str
    shape: torch.Size
    rows: int
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def inner(self) -> int:
        """Elements per row of the parameter (the product of its trailing dimensions)."""
        return math.prod(self.shape[1:])

    @property
    def slot_numel(self) -> int:
        return self.rows * self.inner


@dataclass(frozen=True)
class UnshardedLayout:
    """One FSDP2 parameter group as its reduce-scatter sees it.

    Attributes:
        module: the name of the ``fully_shard``-ed module that owns the group (``""``: root).
        owner: that module (where the reduce-scatter is installed).
        group: FSDP2's parameter group.
        slots: every trainable parameter of the group, in FSDP2's order.
        shards: ``W``, the ranks of the shard dimension.
        row_numel: the elements of one row (the output's size).
    """

    module: str
    owner: Any
    group: Any
    slots: tuple[UnshardedSlot, ...]
    shards: int
    row_numel: int

    @property
    def numel(self) -> int:
        """Elements of the parameters' unsharded gradients together (no padding)."""
        return sum(s.numel for s in self.slots)

    def _check(self, label: str, tensor: torch.Tensor, numel: int) -> None:
        if tensor.dim() != 1 or tensor.numel() != numel:
            raise ValueError(
                f"the reduce-scatter {label} of FSDP module {self.module or '<root>'!r} must be a "
                f"1-D tensor of {numel} elements (its trainable parameters when gradzip was "
                f"registered), got shape {tuple(tensor.shape)}; register again after changing "
                "which parameters require gradients"
            )

    def gather(self, input_tensor: torch.Tensor) -> torch.Tensor:
        """The parameters' unsharded gradients, concatenated in slot order (a new tensor).

        Args:
            input_tensor: FSDP2's reduce-scatter input (``W`` rows of :attr:`row_numel`).

        Raises:
            ValueError: ``input_tensor`` has another size.
        """
        self._check("input", input_tensor, self.shards * self.row_numel)
        rows = input_tensor.view(self.shards, self.row_numel)
        return torch.cat([
            rows[:, s.offset:s.offset + s.slot_numel].reshape(-1)[:s.numel] for s in self.slots
        ])

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """``name -> unsharded gradient``: views of :meth:`gather`'s result."""
        out, at = {}, 0
        for s in self.slots:
            out[s.name] = flat.narrow(0, at, s.numel).view(s.shape)
            at += s.numel
        return out

    def scatter(self, flat: torch.Tensor, output: torch.Tensor, shard: int) -> None:
        """Write rank ``shard``'s row of the reduced gradients ``flat`` into ``output``.

        Args:
            flat: the reduced unsharded gradients, laid out as :meth:`gather` returns them.
            output: FSDP2's reduce-scatter output (:attr:`row_numel` elements), written in
                place, its padding zeroed (what a reduction of zero padding gives).
            shard: this rank's index in the shard dimension.

        Raises:
            ValueError: ``output`` has another size.
        """
        self._check("output", output, self.row_numel)
        at = 0
        for s in self.slots:
            lo = min(shard * s.rows, s.shape[0]) * s.inner
            hi = min((shard + 1) * s.rows, s.shape[0]) * s.inner
            piece = output.narrow(0, s.offset, s.slot_numel)
            piece[:hi - lo].copy_(flat.narrow(0, at + lo, hi - lo))
            piece[hi - lo:].zero_()
            at += s.numel


def unsharded_layout(module_name: str, module: Any, group: Any,
                     names: dict[int, str]) -> UnshardedLayout | None:
    """The layout of one FSDP2 parameter group (``None`` without a trainable parameter).

    Args:
        module_name: the owner's name in the model.
        module: the ``fully_shard``-ed owner.
        group: its FSDP2 parameter group.
        names: ``id(sharded parameter) -> name`` for the model's parameters.

    Raises:
        ValueError: a parameter sharded on a dimension other than 0 (FSDP2 then reorders the
            rows of its gradient; not supported here).
    """
    shards = group.mesh_info.mesh.size()
    slots, offset = [], 0
    for fsdp_param in group.fsdp_params:
        param = fsdp_param.sharded_param
        if not param.requires_grad:
            continue
        name = names[id(param)]
        if fsdp_param.fsdp_placement.dim != 0:
            raise ValueError(
                f"parameter {name!r} is sharded on dimension {fsdp_param.fsdp_placement.dim}; "
                "gradzip's reduce-scatter needs FSDP2's default Shard(0) placement"
            )
        shape = torch.Size(param.shape)
        rows = math.ceil(shape[0] / shards)
        slot = UnshardedSlot(name, shape, rows, offset)
        # FSDP2's padded shard size: the same slot arithmetic the output views use.
        assert slot.slot_numel == math.prod(fsdp_param.padded_sharded_param_size), name
        slots.append(slot)
        offset += slot.slot_numel
    if not slots:
        return None
    return UnshardedLayout(module_name, module, group, tuple(slots), shards, offset)


def default_reduce_scatter() -> Any:
    """FSDP2's own reduce-scatter (what a removed state puts back)."""
    return DefaultReduceScatter()


def unsharded_layouts(model: nn.Module, mesh: DeviceMesh) -> list[UnshardedLayout]:
    """Every parameter group of ``model`` with a trainable parameter, checked.

    Args:
        model: the root module, ``fully_shard``-ed on ``mesh``.
        mesh: the 1-D mesh of the sharding.

    Returns:
        The groups' layouts, in module order.

    Raises:
        TypeError: ``model`` is not ``fully_shard``-ed.
        ValueError: a module sharded on another mesh (a 2-D one included), with several
            parameter groups, a custom reduce-scatter already, or a gradient divide factor;
            a parameter not sharded on dimension 0; no trainable parameter.
        RuntimeError: this torch's FSDP2 lacks what is read here.
    """
    try:
        if DefaultReduceScatter is None:
            raise AttributeError("no torch.distributed.fsdp._fully_shard reduce-scatter interface")
        return _unsharded_layouts(model, mesh)
    except AttributeError as exc:
        raise fsdp2_differs("gradzip's FSDP2 reduce-scatter", exc) from exc


def _unsharded_layouts(model: nn.Module, mesh: DeviceMesh) -> list[UnshardedLayout]:
    names = {id(p): n for n, p in model.named_parameters()}
    out: list[UnshardedLayout] = []
    for module_name, module, where, group in one_group_modules(
            model, mesh, mesh_name="`mesh`", call="mesh=mesh",
            sharding="fully_shard(module, mesh=mesh) (for HSDP use gradzip.fsdp.register)"):
        if not isinstance(group._reduce_scatter_comm, DefaultReduceScatter):
            raise ValueError(
                f"FSDP module {where!r} already has a custom reduce-scatter "
                f"({type(group._reduce_scatter_comm).__name__}); call .remove() on the "
                "state that installed it"
            )
        if group.gradient_divide_factor is not None:
            raise ValueError(f"FSDP module {where!r} has a gradient divide factor "
                             f"({group.gradient_divide_factor}); gradzip's reduce-scatter "
                             "averages (leave set_gradient_divide_factor unset)")
        layout = unsharded_layout(module_name, module, group, names)
        if layout is not None:
            out.append(layout)
    if not out:
        raise ValueError("`model` must have a trainable parameter")
    return out
