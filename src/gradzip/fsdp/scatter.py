"""A compressed reduce-scatter for plain FSDP2: every rank a shard, one mesh dimension.

FSDP2 reduce-scatters each parameter group's unsharded gradients over its (1-D) mesh. Here
that reduce-scatter is replaced (``set_custom_reduce_scatter``) by: the group's unsharded
gradients, named by parameter and in their own shapes (:mod:`gradzip.fsdp.unsharded`),
averaged over every rank by one :class:`~gradzip.Engine` per rank, as the DDP hook averages a
bucket, and this rank's row of the average written to FSDP2's output. The engine compresses
*before* the reduction, so its error-feedback residuals and compressor state are the size of
the unsharded gradients, on every rank: that memory is the price of this mode. The exchange
is the engine's own form for the compressor (an all-reduce of summable payloads, an
all-gather, or its sharded reduce-scatter + all-gather), so every rank receives the whole
average and keeps its row; the byte counters say what it sent, beside what FSDP2's dense
reduce-scatter would have sent.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from gradzip.comm.torch_dist import ProcessGroupCollective
from gradzip.compressors.base import Compressor
from gradzip.ddp.params import tree_to
from gradzip.engine import STATS_KEYS, Engine
from gradzip.fsdp.groups import count_optimizer_step, reduce_every_group, require_fsdp2_method
from gradzip.fsdp.unsharded import (
    ReduceScatter,
    UnshardedLayout,
    default_reduce_scatter,
    unsharded_layouts,
)
from gradzip.options import EngineOptions

__all__ = ["FSDPScatterState", "register_reduce_scatter"]

log = logging.getLogger("gradzip.fsdp")

_FORMAT = "gradzip.fsdp.reduce_scatter/1"


class _Comm(ReduceScatter):  # type: ignore[misc,valid-type]
    """FSDP2's reduce-scatter interface, answered by :meth:`FSDPScatterState.exchange`."""

    def __init__(self, state: FSDPScatterState, layout: UnshardedLayout) -> None:
        self.state, self.layout = state, layout

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any, async_op: bool = False) -> None:
        # Synchronous: FSDP2 waits on the reduce-scatter stream, not on a returned work.
        self.state.exchange(self.layout, input_tensor, output_tensor, op)


class FSDPScatterState:
    """Compressed reduce-scatter of a ``fully_shard``-ed model on a 1-D mesh.

    Built by :func:`register_reduce_scatter`. One :class:`~gradzip.Engine` per rank runs over
    the mesh's process group; its tensors are the parameters' unsharded gradients, named by
    parameter, so its residuals are the size of the unsharded model on every rank.

    Args:
        model: the root module, ``fully_shard``-ed on ``mesh``.
        compressor: a :class:`~gradzip.Compressor` (an Accordion included) or a spec string.
        mesh: the 1-D device mesh the model is sharded on.
        options: an :class:`~gradzip.EngineOptions` (its fields may also be given as keywords).
        **engine_options: fields of :class:`~gradzip.EngineOptions` as keywords.

    Raises:
        TypeError, ValueError: invalid arguments or a model/mesh this adapter does not
            support, naming the parameter.
        RuntimeError: ``torch.distributed`` is not initialised.
    """

    def __init__(self, model: nn.Module, compressor: Compressor | str, *, mesh: Any,
                 options: EngineOptions | None = None, **engine_options: Any) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("gradzip.fsdp needs an initialised torch.distributed process group")
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"`mesh` must be a torch.distributed.device_mesh.DeviceMesh, "
                            f"got {type(mesh).__name__}")
        if mesh.ndim != 1:
            raise ValueError(
                f"`mesh` must be 1-D (every rank a shard), got a {mesh.ndim}-D mesh of shape "
                f"{tuple(mesh.shape)}; for replicate x shard use gradzip.fsdp.register"
            )
        self.layouts: list[UnshardedLayout] = unsharded_layouts(model, mesh)
        #: name -> the parameter's unsharded shape (the engine's tensors).
        self.shapes: dict[str, torch.Size] = {
            s.name: s.shape for layout in self.layouts for s in layout.slots
        }
        self.shards = mesh.size()
        self.shard_rank = mesh.get_local_rank()
        device = next(iter(model.parameters())).device
        collective = ProcessGroupCollective(
            mesh.get_group(), device=None if device.type == "cpu" else device
        )
        self.engine = Engine(self.shapes, compressor, collective=collective,
                             options=EngineOptions.build(options, **engine_options))
        self.compressor = self.engine.compressor
        self.device = device
        self._calls = 0
        #: Bytes FSDP2's own dense reduce-scatter would have sent for the same calls.
        self.reduce_scatter_wire_bytes = 0
        self._modules: list[Any] = []
        # Optimizer steps since registration, carried in every call's header (see
        # FSDPHookState: a rank that stepped its optimizer once more is caught on every rank).
        self._optimizer_steps: int | None = None
        optimizer = self.engine.optimizer
        if optimizer is not None:
            self._optimizer_steps = 0
            while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
                optimizer = optimizer.optimizer
            ref = weakref.ref(self)
            optimizer.register_step_post_hook(lambda *_: count_optimizer_step(ref))

    def exchange(self, layout: UnshardedLayout, input_tensor: torch.Tensor,
                 output: torch.Tensor, op: Any) -> None:
        """One group's reduce-scatter: the average of every rank's unsharded gradients,
        through the engine, this rank's row written to ``output``.

        Args:
            layout: one of :attr:`layouts`.
            input_tensor: FSDP2's reduce-scatter input (not modified).
            output: FSDP2's reduce-scatter output (written).
            op: FSDP2's reduce op: ``AVG`` (its default for fp32/bf16) or ``SUM`` (fp16 or
                forced sums, which FSDP2 divides afterwards).

        Raises:
            ValueError: another op (a custom gradient divide factor), or tensors of another
                size than the layout's.
            FloatingPointError: a non-finite gradient on any rank with ``nonfinite="raise"``
                (on every rank).
            RuntimeError: ranks out of step (on every rank).
        """
        if op == dist.ReduceOp.AVG:
            scale = None
        elif op == dist.ReduceOp.SUM:
            scale = float(self.shards)
        else:
            # Same op on every rank (FSDP2 derives it from the group's settings), so every
            # rank raises here, before any collective of this call.
            raise ValueError(
                f"gradzip's reduce-scatter supports FSDP2's AVG and SUM reductions, got {op!r} "
                "(set_gradient_divide_factor is not supported)"
            )
        flat = layout.gather(input_tensor)
        named = layout.views(flat)
        # Left at 0 if the engine raises: it rolled its step back.
        calls, self._calls = self._calls + 1, 0
        # Why the count closes the step on every rank alike: every rank reduces every group
        # once per backward (unused parameters included, see register_reduce_scatter), in the
        # same order.
        finish = calls == len(self.layouts)
        # Every rank holds the same unsharded shapes in the same group order: the payload's
        # layout is identical, so the header may ride in it.
        self.engine.reduce_bucket(self.engine.bucket_layout(named, flat), finish_step=finish,
                                  step=self._optimizer_steps)
        self._calls = 0 if finish else calls
        self.reduce_scatter_wire_bytes += (
            (self.shards - 1) * layout.row_numel * input_tensor.element_size())
        if scale is not None:
            flat.mul_(scale)
        layout.scatter(flat, output, self.shard_rank)

    # -- observability ---------------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, Any]:
        """This rank's cumulative counters (the engine's, as plain ints), plus
        ``reduce_scatter_wire_bytes`` (what FSDP2's dense reduce-scatter would have sent for
        the same calls) and ``compression_rate`` (that / ``wire_bytes``; ``None`` before any
        byte is sent)."""
        raw = self.engine.stats
        assert tuple(raw) == STATS_KEYS
        out: dict[str, Any] = {
            key: (value[0] if isinstance(value, list) else value) for key, value in raw.items()
        }
        out["reduce_scatter_wire_bytes"] = self.reduce_scatter_wire_bytes
        out["compression_rate"] = (
            self.reduce_scatter_wire_bytes / out["wire_bytes"] if out["wire_bytes"] else None
        )
        return out

    def residual_bytes(self) -> int:
        """Bytes of error-feedback residuals this rank holds (the unsharded gradients')."""
        return sum(r.numel() * r.element_size() for r in self.engine.residuals.values())

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state (tensors and plain values): one entry per rank, e.g. through
        :class:`~gradzip.fsdp.DCPEntry`.

        Raises:
            RuntimeError: called inside a backward pass (between two groups' reductions).
        """
        if self._calls:
            raise RuntimeError("state_dict() must be called between optimizer steps, not "
                               "inside a backward pass")
        return {"format": _FORMAT, "shards": self.shards, "shard_rank": self.shard_rank,
                "reduce_scatter_wire_bytes": self.reduce_scatter_wire_bytes,
                "engine": self.engine.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output of the same rank of a mesh of the same size.

        Raises:
            TypeError: ``state`` is not a mapping.
            ValueError: another format, mesh size or rank, or what
                :meth:`Engine.load_state_dict <gradzip.Engine.load_state_dict>` refuses.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"`state` must be a mapping, got {type(state).__name__}")
        if state.get("format") != _FORMAT:
            raise ValueError(f"`state['format']` must be {_FORMAT!r}, got {state.get('format')!r}")
        for key in ("shards", "shard_rank"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"`state['{key}']` must be {getattr(self, key)} (this rank's mesh), got "
                    f"{state.get(key)!r}: load each rank's own entry on a mesh of the same size"
                )
        for key in ("engine", "reduce_scatter_wire_bytes"):
            if key not in state:
                raise ValueError(f"`state` must hold the key {key!r}")
        self.engine.load_state_dict(tree_to(state["engine"], self.device))
        self.reduce_scatter_wire_bytes = int(state["reduce_scatter_wire_bytes"])
        self._calls = 0

    def remove(self) -> None:
        """Give the model back FSDP2's own reduce-scatter."""
        for module in self._modules:
            module.set_custom_reduce_scatter(default_reduce_scatter())
        self._modules = []

    def __repr__(self) -> str:
        return (f"FSDPScatterState(compressor={self.compressor.spec()!r}, shards={self.shards}, "
                f"parameters={len(self.shapes)})")


def register_reduce_scatter(model: nn.Module, compressor: Compressor | str, *, mesh: Any,
                            options: EngineOptions | None = None,
                            **engine_options: Any) -> FSDPScatterState:
    """Compress plain FSDP2's gradient reduce-scatter through gradzip.

    Call once, after ``fully_shard(module, mesh=mesh)`` on the model and its submodules and
    before the first backward. Each parameter group's reduce-scatter then averages the
    unsharded gradients through one :class:`~gradzip.Engine` per rank and keeps this rank's
    shard. Memory: the engine's residuals (and compressor state) are the size of the
    unsharded trainable parameters on every rank, the price of compressing before the
    reduction; for replicas of a sharded model, :func:`gradzip.fsdp.register` keeps them
    shard-sized. Turns on ``set_reduce_scatter_unused_params(True)`` so that every group is
    reduced every step (unused parameters take zero gradients, as under DDP); on a PyTorch
    without it every parameter must take a gradient in every backward (logged once).

    Args:
        model: the root module, ``fully_shard``-ed on ``mesh``.
        compressor: a :class:`~gradzip.Compressor` or spec string such as ``"topk:ratio=0.01"``.
        mesh: the 1-D :class:`~torch.distributed.device_mesh.DeviceMesh` of the sharding.
        options: an :class:`~gradzip.EngineOptions` record.
        **engine_options: fields of :class:`~gradzip.EngineOptions` as keywords.

    Returns:
        The :class:`FSDPScatterState`: ``stats``, ``residual_bytes()``, ``state_dict()`` (one
        entry per rank), ``load_state_dict()``, ``remove()``.

    Raises:
        TypeError, ValueError: invalid arguments, a model not ``fully_shard``-ed on ``mesh``,
            a 2-D mesh (use :func:`gradzip.fsdp.register`), a module with a custom
            reduce-scatter already (registered twice) or a gradient divide factor.
        RuntimeError: ``torch.distributed`` is not initialised, or this PyTorch's FSDP2 has
            no ``set_custom_reduce_scatter``.
    """
    state = FSDPScatterState(model, compressor, mesh=mesh, options=options, **engine_options)
    require_fsdp2_method((layout.owner for layout in state.layouts), "set_custom_reduce_scatter",
                         "gradzip.fsdp.register_reduce_scatter")
    reduce_every_group(layout.owner for layout in state.layouts)
    for layout in state.layouts:
        layout.owner.set_custom_reduce_scatter(_Comm(state, layout))
        state._modules.append(layout.owner)
    log.debug("registered gradzip %s reduce-scatter on %d parameters (%d shards)",
              state.compressor.spec(), len(state.shapes), state.shards)
    return state
