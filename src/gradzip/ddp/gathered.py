"""Every rank's hook state in one checkpoint, for frameworks where one process writes it.

Accelerate's ``register_for_checkpointing`` and Lightning save from one process; residuals and
warm starts are per rank, so the saved object holds every rank's entry (gathered by a
collective) and each rank loads its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist

from gradzip.ddp.params import tree_to

__all__ = ["PER_RANK", "GatheredState", "rank_entry"]

#: The key of a gathered checkpoint: the list of every rank's state, in rank order.
PER_RANK = "per_rank"


class _HookState(Protocol):
    process_group: dist.ProcessGroup | None

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def rank_entry(state: Mapping[str, Any], rank: int, world: int) -> Mapping[str, Any]:
    """This rank's state: its entry of a gathered checkpoint, or ``state`` itself.

    Raises:
        ValueError: a gathered checkpoint that does not list ``world`` ranks' states.
    """
    if PER_RANK not in state:
        return state
    entries = state[PER_RANK]
    if not isinstance(entries, list) or len(entries) != world:
        raise ValueError(
            f"`state['{PER_RANK}']` must list {world} ranks' states, "
            f"got {len(entries) if isinstance(entries, list) else type(entries).__name__}"
        )
    return entries[rank]


class GatheredState:
    """Checkpoint every rank's hook state in one object (one writer, every rank reads).

    ``state_dict()`` is a collective (``all_gather_object``): every rank must call it, as
    Accelerate's ``save_state`` and Lightning's checkpointing do. ``load_state_dict`` picks this
    rank's entry. Tensors travel and are saved on the CPU.

    Args:
        state: the hook state to wrap (a :class:`~gradzip.ddp.GradzipHookState`).

    Raises:
        TypeError: ``state`` is not a hook state.
    """

    def __init__(self, state: _HookState) -> None:
        if not (callable(getattr(state, "state_dict", None))
                and callable(getattr(state, "load_state_dict", None))
                and hasattr(state, "process_group")):
            raise TypeError(f"`state` must be a GradzipHookState, got {type(state).__name__}")
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        mine = tree_to(self.state.state_dict(), torch.device("cpu"))
        group = self.state.process_group
        entries: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(entries, mine, group=group)
        return {PER_RANK: entries}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.state.load_state_dict(state)

    def __repr__(self) -> str:
        return f"GatheredState({self.state!r})"
