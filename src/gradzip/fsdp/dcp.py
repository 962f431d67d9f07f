"""An HSDP hook state, a compressed reduce-scatter's state or a sharded outer loop inside a ``torch.distributed.checkpoint`` (DCP)
checkpoint.

``dcp.save({"model": model.state_dict(), "gradzip": DCPEntry(state)}, checkpoint_id=folder)``
and the same dict for ``dcp.load``: DCP calls the entry's ``state_dict`` and
``load_state_dict`` as for any ``Stateful`` object.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradzip.ddp.params import tree_to
from gradzip.fsdp.scatter import FSDPScatterState
from gradzip.fsdp.state import FSDPHookState

__all__ = ["DCPEntry"]


class DCPEntry:
    """Per-rank gradzip state as a ``torch.distributed.checkpoint`` ``Stateful`` entry: an
    :class:`FSDPHookState`, an :class:`~gradzip.fsdp.FSDPScatterState` or a
    :class:`~gradzip.ShardedOuter`.

    Every rank's state goes under its own key (``rank00003``: the global rank), serialised as
    one opaque bytes value. Why: DCP keeps one copy of a value saved under the same key by
    every rank (it takes it for replicated), while residuals differ on every rank; and it
    would offer to reshard the tensors, which has no defined meaning for a residual or a warm
    start of another shard layout. Load on a mesh of the same shape: a rank whose key is not
    in the checkpoint makes ``dcp.load`` fail.

    Args:
        state: the hook state, the reduce-scatter state, or a :class:`~gradzip.ShardedOuter`
            (any object whose per-rank ``state_dict()``/``load_state_dict()`` hold tensors
            and plain values).

    Raises:
        TypeError: ``state`` is none of them.
    """

    def __init__(self, state: FSDPHookState | FSDPScatterState | Any) -> None:
        # Checked by what it does, not by class: the sharded outer loop lives above this
        # package (it imports gradzip.fsdp), so naming its class here would be an import cycle.
        if isinstance(state, nn.Module) or not all(
                callable(getattr(state, m, None)) for m in ("state_dict", "load_state_dict")):
            raise TypeError(f"`state` must be an FSDPHookState, an FSDPScatterState or a "
                            f"ShardedOuter, got {type(state).__name__}")
        self.state = state

    @staticmethod
    def _key() -> str:
        return f"rank{dist.get_rank():05d}"

    def state_dict(self) -> dict[str, Any]:
        """``{"rank{global rank:05d}": this rank's state_dict() as torch.save bytes}``."""
        blob = io.BytesIO()
        torch.save(tree_to(self.state.state_dict(), torch.device("cpu")), blob)
        return {self._key(): blob.getvalue()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore this rank's entry of :meth:`state_dict` output.

        Raises:
            TypeError: ``state`` is not a mapping.
            ValueError: this rank's entry is missing or not bytes, or what the state's
                ``load_state_dict`` refuses.
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"`state` must be a mapping, got {type(state).__name__}")
        blob = state.get(self._key())
        if not isinstance(blob, bytes):
            raise ValueError(f"`state['{self._key()}']` must be this rank's saved bytes, "
                             f"got {type(blob).__name__}")
        self.state.load_state_dict(
            torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        )
