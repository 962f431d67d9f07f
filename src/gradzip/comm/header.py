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

from collections.abc import Callable, Mapping, Sequence

import torch

from gradzip.comm.base import Collective, allgather_wire_bytes
from gradzip.ops.flat import cat_rows, to_device
from gradzip.ops.random import stable_hash

__all__ = [
    "HEADER_BYTES", "HeaderRider", "call_code", "make_header", "read_header", "read_summed",
    "rider_bytes", "rider_digit_bits", "summed_row", "verify_configuration",
]

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


def _exact_limit(dtype: torch.dtype) -> int | None:
    """The largest ``M`` such that every integer in ``[0, M]`` is exact in ``dtype``."""
    if dtype == torch.bool or dtype.is_complex:
        return None
    if dtype.is_floating_point:
        return round(2.0 / torch.finfo(dtype).eps)  # 2 ** (mantissa bits + 1)
    return int(torch.iinfo(dtype).max)


def rider_digit_bits(dtype: torch.dtype, world_size: int, *, summed: bool) -> int | None:
    """Bits per digit of the code riding in a message of ``dtype``, or ``None`` where the
    header cannot ride (see the module docstring)."""
    limit = _exact_limit(dtype)
    if limit is None or world_size > limit:
        return None
    for bits in range(_CODE_BITS, 0, -1):
        top = (1 << bits) - 1
        if (world_size * top * top if summed and bits > 1 else top) <= limit:
            return bits
    return None


def rider_bytes(dtype: torch.dtype, world_size: int, *, summed: bool) -> int | None:
    """Bytes per worker the header adds to a message of ``dtype`` it rides in (``None``:
    it cannot ride there and is sent apart, :data:`HEADER_BYTES`)."""
    bits = rider_digit_bits(dtype, world_size, summed=summed)
    if bits is None:
        return None
    digits = -(-_CODE_BITS // bits)
    per_digit = 2 if summed and bits > 1 else 1
    return (digits * per_digit + 1) * torch.empty((), dtype=dtype).element_size()


#: Riding all-reduces whose header the device can check exactly in float64.
_DEVICE_CHECKED = (torch.float32, torch.float16, torch.bfloat16)


def _digits(code: int, bits: int) -> list[int]:
    return [(code >> shift) & ((1 << bits) - 1) for shift in range(0, _CODE_BITS, bits)]


def _summed_values(code: int, bits: int) -> list[int]:
    """The header elements riding in an all-reduce, the non-finite count excepted."""
    return [v for d in _digits(code, bits) for v in ((d, d * d) if bits > 1 else (d,))]


def summed_row(code: int, bits: int, nonfinite: bool) -> list[int]:
    """The header elements one worker appends to a summed message (digits of ``code`` and
    their squares at ``bits`` bits per digit, then its non-finite flag)."""
    return [*_summed_values(code, bits), int(nonfinite)]


def read_summed(sums: Sequence[int], world_size: int, bits: int) -> tuple[bool, bool]:
    """(every worker sent the same code, some worker's gradient is non-finite) from the sum
    of every worker's :func:`summed_row`."""
    step = 2 if bits > 1 else 1
    agreed = all(
        world_size * sums[i + step - 1] == sums[i] * sums[i] for i in range(0, len(sums) - 1, step)
    )
    return agreed, sums[-1] > 0


class HeaderRider(Collective):
    """The engine's collective for one call, carrying the header in its first message.

    Used only where the caller guarantees the payload's layout is identical on every rank
    (see the module docstring). Metering goes to the wrapped collective's meter: the extra
    elements are counted as the bytes they are.

    With ``nonfinite`` a device tensor, a riding all-reduce in fp32, fp16 or bf16 is checked
    on the device without a host read: :attr:`bad_flag` (some worker's gradient is
    non-finite) and :attr:`disagree` (the ranks' codes differ) are then 0-d bool tensors,
    for the caller to act on with ``torch.where`` and to read later. Every other case (an
    all-gather, the separate header) reads on the host as above.

    Args:
        comm: the collective the call would use.
        code: this call's code (:func:`call_code`).
        nonfinite: per local worker, whether its compensated gradient holds NaN or Inf (a
            list, or an ``[L]`` bool tensor for the device check).
        refuse: called (it raises) when the ranks' codes differ, before any further
            collective.
    """

    def __init__(
        self,
        comm: Collective,
        code: int,
        nonfinite: Sequence[bool] | torch.Tensor,
        refuse: Callable[[], None],
    ) -> None:
        # No super().__init__: the meter is the wrapped collective's own.
        self.comm, self.code, self.refuse = comm, code, refuse
        self.flags = nonfinite if isinstance(nonfinite, torch.Tensor) else None
        self._listed = None if self.flags is not None else list(nonfinite)  # type: ignore[arg-type]
        self.world_size, self.local_workers = comm.world_size, comm.local_workers
        self.first_rank, self.meter, self.simulated = comm.first_rank, comm.meter, comm.simulated
        self.bad: bool | None = None  # some worker's gradient is non-finite (read on the host)
        self.bad_flag: torch.Tensor | None = None  # the same, checked on the device
        self.disagree: torch.Tensor | None = None  # the codes differ (device check only)

    @property
    def nonfinite(self) -> list[bool]:
        """The local flags as a list (a host read when they live on the device)."""
        if self._listed is None:
            assert self.flags is not None
            self._listed = [bool(v) for v in self.flags.tolist()]
        return self._listed

    @property
    def done(self) -> bool:
        return self.bad is not None or self.bad_flag is not None

    def _sum(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - never reached
        raise NotImplementedError

    def _gather(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - never reached
        raise NotImplementedError

    def _row_parts(self, values: list[int], x: torch.Tensor) -> list[torch.Tensor]:
        """The header rows (``[L, len(values) + 1]`` in all) as column blocks to concatenate
        after the message: ``[values, flag]`` on the device path, one block on the host path.

        Why blocks: the caller's one ``cat`` of the message and the header then joins them,
        one copy fewer per call than concatenating the rows first (the bytes on the wire, and
        their order, are the same).
        """
        if self.flags is not None and self._listed is None:  # built on the device
            fixed = to_device(torch.tensor([values] * self.local_workers, dtype=x.dtype), x.device)
            return [fixed, self.flags.to(device=x.device, dtype=x.dtype)[:, None]]
        rows = torch.tensor([[*values, int(bad)] for bad in self.nonfinite], dtype=x.dtype)
        return [to_device(rows, x.device)]

    def _rows(self, values: list[int], x: torch.Tensor) -> torch.Tensor:
        parts = self._row_parts(values, x)
        return parts[0] if len(parts) == 1 else torch.cat(parts, 1)

    def _separate(self) -> None:
        total = self.comm.all_reduce(make_header(self.code, self.nonfinite))
        agreed, self.bad = read_header(total, self.world_size)
        if not agreed:
            self.refuse()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` (the first call appends the header, reads it and strips it)."""
        if self.done:
            return self.comm.all_reduce(x)
        self._check(x)
        bits = rider_digit_bits(x.dtype, self.world_size, summed=True)
        if bits is None:
            self._separate()
            return self.comm.all_reduce(x)
        values = _summed_values(self.code, bits)
        flat = x.reshape(self.local_workers, -1)
        n = flat.shape[1]
        riding = torch.cat([flat, *self._row_parts(values, x)], dim=1)
        return self._sum_riding(riding, n, bits).reshape(x.shape[1:])

    def _sum_riding(self, riding: torch.Tensor, n: int, bits: int) -> torch.Tensor:
        """All-reduce ``riding`` (``[L, n + header]``), check the header, return ``[n]``."""
        total = self.comm.all_reduce(riding)
        world, step = self.world_size, 2 if bits > 1 else 1
        if self.flags is not None and self._listed is None and riding.dtype in _DEVICE_CHECKED:
            # In float64 every sum and product here is exact: sums are at most
            # ``W * (2 ** k - 1) ** 2 <= 2 ** 24`` and ``W <= 2 ** 24``, so ``s1 ** 2`` and
            # ``W * s2`` stay below ``2 ** 48``.
            tail = total[n:].to(torch.float64)
            s1, s2 = tail[0:-1:step], tail[step - 1 : -1 : step]
            self.disagree = ~(world * s2 == s1 * s1).all()
            self.bad_flag = tail[-1] > 0
            return total[:n]
        agreed, self.bad = read_summed([int(v) for v in total[n:].tolist()], world, bits)
        if not agreed:
            self.refuse()
        return total[:n]

    def all_reduce_cat(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """:meth:`all_reduce` of the parts' concatenation, the header rows appended in the
        same copy (the first call only)."""
        if self.done or not parts:
            return super().all_reduce_cat(parts)
        bits = rider_digit_bits(parts[0].dtype, self.world_size, summed=True)
        if bits is None:
            return super().all_reduce_cat(parts)
        values = _summed_values(self.code, bits)
        rows = self._row_parts(values, parts[0])
        riding = cat_rows([*parts, *rows], self.local_workers)
        return self._sum_riding(riding, riding.shape[1] - (len(values) + 1), bits)

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`Collective.all_to_all` (the first call appends the header to every part,
        reads it and strips it).

        Why every part carries it: worker ``i`` receives part ``i`` of every worker, so each
        worker sees every worker's header row (the agreement and the non-finite flags), as
        in an all-gather, and all take the same decision.
        """
        if self.done:
            return self.comm.all_to_all(x)
        self._check(x)
        bits = rider_digit_bits(x.dtype, self.world_size, summed=False)
        if bits is None or x.dim() < 2 or x.shape[1] != self.world_size:
            self._separate()
            return self.comm.all_to_all(x)
        digits = _digits(self.code, bits)
        parts = x.reshape(self.local_workers, self.world_size, -1)
        rows = self._rows(digits, x)  # [L, header]: this worker's row, in every part
        riding = torch.cat([parts, rows[:, None].expand(-1, self.world_size, -1)], dim=2)
        received = self.comm.all_to_all(riding)
        n = parts.shape[2]
        head = received[:, :, n:]  # [L, W senders, header]
        out = received[:, :, :n].reshape(x.shape)
        if self.flags is not None and self._listed is None:
            # Flags built on the device: checked there, without a host read (see all_gather).
            self.disagree = (head[..., :-1] != rows[:1, None, :-1]).any()
            self.bad_flag = (head[..., -1] > 0).any()
            return out
        seen = [[int(v) for v in row] for row in head.reshape(-1, head.shape[2]).tolist()]
        self.bad = any(row[-1] > 0 for row in seen)
        if any(row[:-1] != digits for row in seen):
            self.refuse()
        return out

    def all_gather(
        self, x: torch.Tensor, payload: Sequence[int] | None = None, *, metered: bool = True
    ) -> torch.Tensor:
        """Gather ``x`` (the first call appends the header, reads it and strips it)."""
        if self.done or not metered:
            return self.comm.all_gather(x, payload, metered=metered)
        self._check(x)
        bits = rider_digit_bits(x.dtype, self.world_size, summed=False)
        if bits is None:
            self._separate()
            return self.comm.all_gather(x, payload, metered=metered)
        digits = _digits(self.code, bits)
        flat = x.reshape(self.local_workers, -1)
        extra = (len(digits) + 1) * x.element_size()
        if payload is None:
            payload = [flat.shape[1] * x.element_size()] * self.local_workers
        rows = self._row_parts(digits, x)
        gathered = self.comm.all_gather(torch.cat([flat, *rows], dim=1),
                                        [p + extra for p in payload])
        n = flat.shape[1]
        if self.flags is not None and self._listed is None:
            # Flags built on the device (the device path): checked there too, as in
            # _sum_riding, so the call makes no host read. Every digit is exact in the
            # message's dtype (rider_digit_bits), so comparing the gathered rows with this
            # rank's own is exact; ranks out of step are found at the step's end.
            head = gathered[:, n:]
            # rows[0] is this rank's digits alone (the flag is its own block).
            self.disagree = (head[:, :-1] != rows[0][:1]).any()
            self.bad_flag = (head[:, -1] > 0).any()
            return gathered[:, :n].reshape(self.world_size, *x.shape[1:])
        seen = [[int(v) for v in row] for row in gathered[:, n:].tolist()]
        self.bad = any(row[-1] > 0 for row in seen)
        if any(row[:-1] != digits for row in seen):
            self.refuse()
        return gathered[:, :n].reshape(self.world_size, *x.shape[1:])

    def finish(self) -> bool:
        """After the call's last collective: whether some worker's gradient is non-finite
        (exchanging the separate header now if no collective carried it)."""
        if not self.done:
            self._separate()
        if self.bad is None:
            assert self.bad_flag is not None
            self.bad = bool(self.bad_flag)
        return self.bad

    def finish_on_device(self, device: torch.device) -> torch.Tensor:
        """:meth:`finish` as a 0-d bool tensor on ``device``, without a host read where the
        header rode in a device-checked all-reduce."""
        if not self.done:
            self._separate()
        if self.bad_flag is None:
            self.bad_flag = torch.full((), bool(self.bad), dtype=torch.bool, device=device)
        return self.bad_flag
