"""The fixed-size header every engine call exchanges before its payload.

Why a separate message at all: a payload's size depends on the tensors of the call, so a rank
that lost a tensor, skipped a call or runs a step behind would issue a collective of another
size, and gloo aborts the whole process ("Received data size doesn't match") before any Python
code can react; a rank a step behind with the same sizes is silently averaged with another
step. Only a message whose size never depends on the call can be checked *before* the payload,
so each call starts with one all-reduce of three int64 per worker (:data:`HEADER_BYTES`):

``[code, code ** 2, nonfinite]``

* ``code`` is a 24-bit hash of (step, call index within the step, ``finish_step``, the caller's
  step number if given, the set of tensor names and shapes). With ``W`` workers, ``W * sum(code
  ** 2) == sum(code) ** 2`` holds exactly when every worker sent the same code
  (Cauchy-Schwarz), so a sum, the one collective every backend has, detects any disagreement;
  the sums stay below ``2 ** 63`` up to 32768 workers.
* ``nonfinite`` counts the workers whose error-compensated gradient holds NaN or Inf, so every
  worker applies the non-finite policy to the same calls.

Engines that keep state used to all-reduce a 4-byte non-finite flag per call; the header
replaces it, so their count of collectives per call is unchanged. Engines without state pay
one more, 24-byte all-reduce per call: the price of detecting a desynchronised rank before
it can abort the process. The header is metered like any other message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from gradzip.comm.base import Collective, allgather_wire_bytes
from gradzip.ops.random import stable_hash

__all__ = ["HEADER_BYTES", "call_code", "make_header", "read_header", "verify_configuration"]

HEADER_FIELDS = 3
HEADER_BYTES = 8 * HEADER_FIELDS
_CODE_BITS = 24


def call_code(
    step: int, call: int, finish_step: bool, user_step: int | None, set_code: int, count: int
) -> int:
    """The 24-bit code of one call: equal on two ranks when they make the same call."""
    return stable_hash("call", step, call, finish_step, user_step, set_code, count) & (
        (1 << _CODE_BITS) - 1
    )


def make_header(code: int, nonfinite: Sequence[bool]) -> torch.Tensor:
    """``[L, 3]`` int64: one header row per local worker."""
    return torch.tensor([[code, code * code, int(bad)] for bad in nonfinite], dtype=torch.int64)


def read_header(total: torch.Tensor, world_size: int) -> tuple[bool, bool]:
    """(every worker sent the same code, some worker's gradient is non-finite) from the sum."""
    s1, s2, bad = (int(v) for v in total.tolist())
    return world_size * s2 == s1 * s1, bad > 0


def verify_configuration(comm: Collective, fields: Mapping[str, str]) -> int:
    """Check that every rank holds the same value of every field (once, before the first step).

    Ranks that disagree on the compressor, options or parameters would issue collectives of
    different sizes and hang or average garbage; a hash of each field gathered from every rank
    turns that into an error naming what differs.

    Args:
        comm: the collective.
        fields: name -> this rank's value.

    Returns:
        The wire bytes the exchange cost this worker (not metered with the gradient traffic).

    Raises:
        ValueError: ranks disagree; the first field that differs is named.
    """
    mine = torch.tensor([[stable_hash(v) for v in fields.values()]], dtype=torch.int64)
    theirs = comm.all_gather(mine, metered=False)  # [W, fields]
    for col, (key, value) in enumerate(fields.items()):
        column = theirs[:, col].tolist()
        if len(set(column)) > 1:
            odd = next(r for r, c in enumerate(column) if c != column[comm.first_rank])
            raise ValueError(
                f"ranks disagree on `{key}`: rank {comm.first_rank} has {value!r}, rank {odd} "
                f"has a different value; every rank must build the engine with the same "
                f"compressor, options and parameters"
            )
    return allgather_wire_bytes(mine.numel() * 8, comm.world_size)
