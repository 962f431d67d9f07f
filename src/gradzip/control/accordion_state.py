"""Accordion's controller state as tensors where it changes every step, read at decisions only.

Why tensors: the engine may keep a call's non-finite decision on the device (no host read; see
``gradzip.engine.device``), and then undoes a rolled-back call by ``torch.where`` over the
state's tensors, which cannot undo a plain value. So what changes every step or every call
lives in tensors, moved to the gradients' device at the first call:

* ``step``: 0-d int64, the optimizer steps the controller counted (a skipped step is rolled
  back with the rest of the state, so it is not counted, on either path);
* ``tally``: 0-d int64 counts of tensor-steps reduced at each level;
* ``acc``: the window sums, accumulated by two multi-tensor ops per call, weighted by whether
  the counted step lies in the window (a 0-d tensor, so a step skipped without the host
  knowing is not summed).

The host keeps ``offset``, the engine's step minus the counted step as of the last read:
``ctx.step - offset`` is then the counted step, or more where steps were skipped since (never
less), which is enough to know when a decision *may* be due; the one read at that point
(the norms and the counted step together) tells whether it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gradzip.ops.flat import unpack
from gradzip.statecheck import nonneg_int

__all__ = ["TALLY", "add_tally", "counted_step", "fresh_tally", "upgrade_controller",
           "weighted_sums", "zeroed"]

#: Tensor-steps reduced at each level, counted on the device.
TALLY = ("steady_steps", "critical_steps", "dense_steps")


def fresh_tally() -> dict[str, torch.Tensor]:
    """Zero counts (0-d int64 on the CPU; they move to the gradients' device at the first
    call)."""
    return {key: torch.zeros((), dtype=torch.int64) for key in TALLY}


def counted_step(ctrl: Mapping[str, Any]) -> int:
    """The counted step (one host read where the counter lives on a GPU)."""
    return int(ctrl["step"])


def add_tally(tally: Mapping[str, torch.Tensor], added: Mapping[str, int],
              device: torch.device) -> dict[str, torch.Tensor]:
    """``tally`` with ``added`` counted (one op per nonzero count, no host read; the tensors
    are replaced, never written into)."""
    out = dict(tally)
    for key, n in added.items():
        if n:
            out[key] = out[key].to(device) + n
    return out


def zeroed(acc: Mapping[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """Window sums set back to zero: views of one zero buffer on the sums' device (one op);
    entries not made yet (``None``) stay so."""
    made = [(n, t) for n, t in acc.items() if t is not None]
    if not made:
        return dict(acc)
    device = made[0][1].device
    total = sum(t.numel() for _, t in made)
    views = unpack(torch.zeros(total, dtype=torch.float32, device=device), [t.shape for _, t in made])
    zeros = dict(zip((n for n, _ in made), views, strict=True))
    return {n: zeros.get(n) for n in acc}


def weighted_sums(old: list[torch.Tensor | None], values: list[torch.Tensor],
                  weight: torch.Tensor) -> list[torch.Tensor]:
    """``old + weight * value`` for each pair (``weight`` a 0-d float32 of 0 or 1 on the
    values' device; ``None`` counts as zero): two multi-tensor ops.

    Bit for bit the plain sum where ``weight`` is 1 (``x * 1 == x``), and ``old`` where it is
    0, but for the sign of a zero, which no norm sees.
    """
    scaled = list(torch._foreach_mul(values, weight))
    made = [i for i, t in enumerate(old) if t is not None]
    if made:
        summed = torch._foreach_add([old[i].to(values[i].device) for i in made],  # type: ignore[union-attr]
                                    [scaled[i] for i in made])
        for i, t in zip(made, summed, strict=True):
            scaled[i] = t
    return scaled


def upgrade_controller(ctrl: Any, *, fresh: Mapping[str, Any], step: int,
                       interval: int) -> Any:
    """An Accordion controller saved by the earlier layout (plain ``step`` and per-level
    counts, a ``pending`` flag with ``next`` already advanced, window sums ``None`` outside
    the window) in the current one; anything else unchanged.

    Args:
        ctrl: the loaded controller sub-state.
        fresh: the fresh controller sub-state of the engine loading it.
        step: the engine's step count in the checkpoint.
        interval: the Accordion's ``interval``.

    Raises:
        ValueError: an earlier layout whose step count cannot be read.
    """
    if not isinstance(ctrl, Mapping) or "pending" not in ctrl or "offset" in ctrl:
        return ctrl
    old_step = ctrl.get("step")
    if not nonneg_int(old_step) or old_step > step:
        raise ValueError(
            "checkpoint holds an Accordion state of an earlier layout whose "
            f"compressor_state.controller.step must be an integer in [0, {step}] (the "
            f"engine's steps), got {old_step!r}"
        )
    new = {k: v for k, v in ctrl.items() if k != "pending"}
    counts = dict(ctrl["counts"]) if isinstance(ctrl.get("counts"), Mapping) else {}
    tally = {k: torch.tensor(int(counts.pop(k, 0)), dtype=torch.int64) for k in TALLY}
    nxt = ctrl.get("next")
    if ctrl["pending"] is True and nonneg_int(nxt):
        # The earlier layout advanced `next` when the decision fell due and took it at the
        # next call; the current one advances it when the decision is taken.
        nxt = int(nxt) - interval
    fresh_acc = fresh.get("acc", {})
    acc = ctrl.get("acc")
    if isinstance(acc, Mapping):
        acc = {n: (fresh_acc.get(n) if t is None else t) for n, t in acc.items()}
    new.update(step=torch.tensor(int(old_step), dtype=torch.int64), offset=step - int(old_step),
               host_step=None,
               next=nxt, counts=counts, tally=tally, acc=acc)
    return new
