"""DistributedDataParallel communication hook: gradzip's engine behind DDP's buckets.

A thin adapter. DDP hands the hook one *bucket* (a flat buffer holding several parameters'
local gradients) at a time; the hook looks the parameters up by name, lets one
:class:`~gradzip.Engine` average them through the compressor, writes the averages back into
the bucket's buffer and completes the future it returned. By default (``overlap=True``) that
work runs on a communication thread while autograd computes the later buckets, as native DDP
overlaps its all-reduces; ``overlap=False`` runs it inside the hook (the baseline, and the
simplest to debug). Both give the same results bit for bit.

Why it is shaped this way (each point is a failure of hooks keyed differently):

* **State is keyed by parameter name, never by bucket index.** DDP rebuilds its buckets after
  the first iteration (and their number depends on ``bucket_cap_mb``), so bucket indices do
  not name the same tensors from one iteration to the next. Keyed by name, compression works
  from the very first step, across the rebuild, and a restored state works on the first step
  after resume.
* **Collectives are issued in bucket order, from one queue**, identical on every rank (DDP
  launches buckets in index order). Nothing is issued from, or waits inside, a
  ``Future.then()`` callback: PyTorch's ``powerSGD_hook``, which chains its all-reduces that
  way, deadlocks on gloo at its first compressed step once there are two or more buckets.
  With ``overlap=True`` one thread per process runs the buckets' work in arrival order on a
  private copy of the process group (see :mod:`gradzip._ddp_thread` for why a copy); with
  ``overlap=False`` the hook runs it itself, on DDP's group.
* **Errors reach every rank.** An exception in a bucket's work completes that bucket's future
  with it, so DDP raises it at the end of the backward pass; later buckets of the same hook
  state then fail at once without issuing collectives (the ranks' sequences no longer
  match). A rank whose peer failed sees its own collective fail when the peer's process
  exits, or at the process group's timeout; it never waits forever.
* **Reading state waits for the work in flight**: ``stats``, ``state_dict()`` and
  ``load_state_dict()`` first wait for every queued bucket.
* **One optimizer step per backward.** The last bucket of a backward (``bucket.is_last()``)
  finishes the engine's step; micro-batches under ``ddp_model.no_sync()`` never reach the hook,
  so ``stats["steps"]`` counts optimizer steps under gradient accumulation.
* **Non-finite gradients** (``nonfinite="skip"``, the default): every rank agrees that some
  gradient holds NaN/Inf (a count in the bucket's header), all compression state rolls back to
  where the step began and the bucket is filled with NaN, so a ``GradScaler`` (or any finite
  check) skips the step. On CUDA, with ``none``, ``fp16``, ``bf16``, ``randk`` or
  ``powersgd``, that decision stays on the device (``torch.where``, no host read per
  bucket); the headers' agreement is read once per step, at the last bucket.

Byte counts in :attr:`GradzipHookState.stats` (cumulative, for this rank):

* ``payload_bytes``: the bytes of every message this rank contributed to a collective
  (compressed values, indices, sizes exchanged before a padded all-gather, PowerSGD's ``P`` and
  ``Q`` factors and the tensors sent dense beside them, and each bucket's call header: a few
  elements appended to the bucket's first collective, since DDP guarantees every rank the same
  buckets (see :mod:`gradzip.comm.header`), so ``none``, ``fp16`` and ``bf16`` make one
  collective per bucket). The one-off configuration handshake before the first step is
  counted apart, in ``handshake_bytes``.
* ``wire_bytes``: what a ring algorithm makes this rank send for those messages
  (``2 (W-1)/W`` times the message for an all-reduce, ``(W-1)`` times the padded message for
  an all-gather).
* ``dense_payload_bytes`` / ``dense_wire_bytes``: the same for the uncompressed fp32
  all-reduce of every gradient DDP would do without a hook.

For comparison, PyTorch's built-in ``powerSGD_hook`` all-reduces, per step, the full bucket
during its ``start_powerSGD_iter`` warm-up iterations, then three fp32 buffers: the
uncompressed tensors (1-D ones and those low rank would not shrink enough), all ``P`` factors
and all ``Q`` factors. gradzip's PowerSGD sends the same ``P`` and ``Q`` (the dense tensors ride
in the ``P`` buffer) from the first step on.

Example:
    >>> ddp_model = DistributedDataParallel(model)
    >>> state = gradzip.ddp.register(ddp_model, "powersgd:rank=2", optimizer=optimizer)
    >>> ...train...; torch.save(state.state_dict(), f"gradzip-rank{rank}.pt")
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradzip._ddp_thread import comm_thread, private_group
from gradzip._validate import check_bool
from gradzip.comm.torch_dist import ProcessGroupCollective
from gradzip.compressors.base import Compressor
from gradzip.engine import STATS_KEYS, Engine
from gradzip.options import EngineOptions
from gradzip.spec import compressor_from_spec

__all__ = ["GatheredState", "GradzipHookState", "gradzip_hook", "make_hook", "register"]

log = logging.getLogger(__name__)

_PER_RANK = "per_rank"


def _named_parameters(
    model_or_named_params: nn.Module | Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    if isinstance(model_or_named_params, DistributedDataParallel):
        model_or_named_params = model_or_named_params.module
    if isinstance(model_or_named_params, nn.Module):
        pairs = list(model_or_named_params.named_parameters())
    elif isinstance(model_or_named_params, Iterable) and not isinstance(
        model_or_named_params, (str, torch.Tensor, Mapping)
    ):
        pairs = list(model_or_named_params)
        for item in pairs:
            if not (
                isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)
            ):
                raise TypeError(
                    f"`model_or_named_params` must hold (name, parameter) pairs, got {item!r}"
                )
    else:
        raise TypeError(
            "`model_or_named_params` must be a module, a DistributedDataParallel model or "
            f"(name, parameter) pairs, got {type(model_or_named_params).__name__}"
        )
    pairs = [(str(n), p) for n, p in pairs if p.requires_grad]
    if not pairs:
        raise ValueError("`model_or_named_params` must hold at least one trainable parameter, got none")
    return pairs


def _tree_to(tree: Any, device: torch.device) -> Any:
    """Move every tensor of a nested dict/list to ``device`` (checkpoints load on CPU)."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, Mapping):
        return {k: _tree_to(v, device) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_tree_to(v, device) for v in tree]
    return tree


class GradzipHookState:
    """The state a DDP comm hook receives: one :class:`~gradzip.Engine`, built on first use.

    The engine is created lazily (on the first bucket, or on :meth:`load_state_dict` /
    :attr:`engine` access once ``torch.distributed`` is initialised), so a state can be made
    before the process group exists, as Lightning's ``DDPStrategy(ddp_comm_state=...)`` needs.

    Args:
        named_params: ``(name, parameter)`` pairs of the wrapped module; buckets' parameters
            are matched to names by identity.
        compressor: a :class:`~gradzip.Compressor` (an Accordion included) or a spec string.
        process_group: the group DDP reduces over; ``None`` is the world group.
        options: an :class:`~gradzip.EngineOptions` (error feedback, non-finite policy,
            optimizer, grad scaler, ``dense_1d``, ``rules``, ``min_numel``: documented there).
        **engine_options: the same options as keywords (they replace the record's fields).
        overlap: run each bucket's work on the communication thread while autograd computes
            later buckets (the default); ``False`` runs it inside the hook, synchronously.

    Raises:
        TypeError, ValueError: invalid arguments, naming the parameter.
    """

    def __init__(
        self,
        named_params: Iterable[tuple[str, torch.Tensor]],
        compressor: Compressor | str,
        *,
        process_group: dist.ProcessGroup | None = None,
        overlap: bool = True,
        options: EngineOptions | None = None,
        **engine_options: Any,
    ) -> None:
        pairs = _named_parameters(named_params)
        self.compressor = compressor_from_spec(compressor)
        self.options = options = EngineOptions.build(options, **engine_options)
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"`process_group` must be a torch.distributed.ProcessGroup or None, "
                f"got {type(process_group).__name__}"
            )
        # The options' values, as attributes (read by frameworks' adapters and users).
        self.error_feedback = options.error_feedback
        self.nonfinite = options.nonfinite
        self.optimizer = options.optimizer
        self.grad_scaler = options.grad_scaler
        self.dense_1d = options.dense_1d
        self.overlap = check_bool("overlap", overlap)
        self.process_group = process_group
        self.params: dict[str, torch.Tensor] = dict(pairs)
        # Identity of the parameter objects (DDP hands back the very same objects).
        self._name_of: dict[int, str] = {id(p): n for n, p in pairs}
        self._engine: Engine | None = None
        self._pending: Mapping[str, Any] | None = None
        # Overlap mode: the first error of a bucket's work (sticky: once one bucket failed,
        # the ranks' sequences of collectives no longer match), and whether the engine
        # talks on the communication thread's private group yet.
        self._failure: BaseException | None = None
        self._private_group = False

    # -- the engine ------------------------------------------------------------------------
    @property
    def engine(self) -> Engine:
        """The engine (created now if needed; needs an initialised process group)."""
        if self._engine is None:
            device = next(iter(self.params.values())).device
            # Collectives run where the parameters live (control messages made on the CPU
            # travel through that device: NCCL cannot reduce CPU tensors).
            collective = ProcessGroupCollective(
                self.process_group, device=None if device.type == "cpu" else device
            )
            engine = Engine(
                {n: p.shape for n, p in self.params.items()},
                self.compressor,
                collective=collective,
                options=self.options,
            )
            self._engine = engine
            if self._pending is not None:
                pending, self._pending = self._pending, None
                self.load_state_dict(pending)
        return self._engine

    def name_of(self, param: torch.Tensor) -> str:
        """The name of a parameter of the wrapped module.

        Raises:
            KeyError: ``param`` is not one of the parameters this state was built from.
        """
        try:
            return self._name_of[id(param)]
        except KeyError:
            raise KeyError(
                f"a DDP bucket holds a parameter of shape {tuple(param.shape)} that is not among "
                f"the {len(self.params)} parameters this hook state was built from; build the "
                "state from the module DDP wraps"
            ) from None

    # -- the work of one bucket --------------------------------------------------------------
    def _named_grads(self, bucket: dist.GradBucket) -> dict[str, torch.Tensor]:
        grads = bucket.gradients()  # views into bucket.buffer()
        return {self.name_of(p): g for p, g in zip(bucket.parameters(), grads, strict=True)}

    def _reduce_bucket(
        self, engine: Engine, named: dict[str, torch.Tensor], finish_step: bool
    ) -> None:
        # DDP checked at construction that every rank holds the same parameters and hands
        # every rank the same buckets in the same order (rebuilt buckets follow rank 0's
        # order), so the payload's layout is identical on every rank: the header may ride in
        # it (see gradzip.comm.header).
        averaged = engine.reduce(named, finish_step=finish_step, same_layout=True)
        for name, grad in named.items():
            grad.copy_(averaged[name])

    def _submit(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Queue one bucket's work on the communication thread (``overlap=True``)."""
        buffer = bucket.buffer()
        worker = comm_thread()
        try:
            if self._failure is not None:
                raise self._failed()
            engine = self.engine
            if not self._private_group:
                # Every member reaches its first bucket in the same order: the one moment
                # all of them can make the thread's group together.
                engine.comm.group = private_group(self.process_group)  # type: ignore[attr-defined]
                self._private_group = True
            named = self._named_grads(bucket)
            finish_step = bucket.is_last()
        except BaseException as exc:  # noqa: BLE001 - reported through the future
            self._failure = self._failure or exc
            return worker.submit(_raiser(exc), buffer.device)

        def work() -> torch.Tensor:
            if self._failure is not None:
                raise self._failed()
            try:
                self._reduce_bucket(engine, named, finish_step)
            except BaseException as exc:
                self._failure = exc
                raise
            return buffer

        return worker.submit(work, buffer.device)

    def _failed(self) -> RuntimeError:
        error = RuntimeError(
            "gradzip's DDP hook stopped after an earlier bucket failed "
            f"({type(self._failure).__name__}: {self._failure}); the ranks' collectives no "
            "longer match, so this hook state cannot continue"
        )
        error.__cause__ = self._failure
        return error

    def wait(self) -> None:
        """Wait until the work of every bucket handed over so far has finished (``overlap``
        mode; DDP itself waits at the end of each backward pass). ``stats``,
        ``state_dict()`` and ``load_state_dict()`` call it first."""
        if self.overlap:
            comm_thread().drain()

    # -- observability ---------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, Any]:
        """This rank's cumulative counters (the engine's, as plain ints; see the module
        docstring for the byte counts), plus ``compression_rate`` (dense wire bytes / wire
        bytes, ``None`` before any byte is sent) and ``levels`` (from the compressor's
        ``current_levels(state)`` when it has one, e.g. an Accordion, else ``None``)."""
        self.wait()
        if self._engine is None:
            # The same keys as once the engine exists (zeros: nothing was sent yet).
            return {**dict.fromkeys(STATS_KEYS, 0), "compression_rate": None, "levels": None}
        raw = self._engine.stats
        out: dict[str, Any] = {
            key: (value[0] if isinstance(value, list) else value) for key, value in raw.items()
        }
        out["compression_rate"] = (
            out["dense_wire_bytes"] / out["wire_bytes"] if out["wire_bytes"] else None
        )
        out["levels"] = self._levels()
        return out

    def _levels(self) -> Any:
        # Adaptive compressors may expose their current choice; others have none. With
        # rules, the choices of every compressor that reports one are merged (names differ).
        engine = self._engine
        if engine is None:
            return None
        pairs = [(self.compressor, engine.compressor_state)] + [
            (c, s) for c, s in zip(engine.rule_compressors, engine.rule_states, strict=True)
        ]
        found = None
        for compressor, state in pairs:
            helper = getattr(compressor, "current_levels", None)
            if callable(helper):
                found = {**(found or {}), **helper(state)}
        return found

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state (tensors and plain values): save one file per rank.

        Raises:
            RuntimeError: called inside a step, or before the process group exists with
                nothing loaded.
        """
        self.wait()
        if self._engine is None and self._pending is not None:
            return dict(self._pending)
        return self.engine.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (or this rank's entry of a :class:`GatheredState`
        checkpoint); tensors move to the parameters' device.

        Before the process group exists the state is kept and applied when the engine is
        created.

        Raises:
            TypeError, ValueError: not a gradzip state, or one of another compressor, world
                size, rank, or parameter set (the engine names the first mismatch).
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"`state` must be a mapping, got {type(state).__name__}")
        self.wait()
        if self._engine is None and not dist.is_initialized():
            self._pending = state
            return
        engine = self.engine
        if _PER_RANK in state:
            entries = state[_PER_RANK]
            rank = engine.comm.first_rank
            if not isinstance(entries, list) or len(entries) != engine.comm.world_size:
                raise ValueError(
                    f"`state['{_PER_RANK}']` must list {engine.comm.world_size} ranks' states, "
                    f"got {len(entries) if isinstance(entries, list) else type(entries).__name__}"
                )
            state = entries[rank]
        device = next(iter(self.params.values())).device
        engine.load_state_dict(_tree_to(state, device))

    def gathered(self) -> GatheredState:
        """A view whose checkpoints hold every rank's state, for frameworks where one process
        writes the checkpoint (Accelerate's ``register_for_checkpointing``, Lightning)."""
        return GatheredState(self)

    def __repr__(self) -> str:
        return (
            f"GradzipHookState(compressor={self.compressor.spec()!r}, "
            f"parameters={len(self.params)}, steps={self.stats['steps']})"
        )


class GatheredState:
    """Checkpoint every rank's hook state in one object (one writer, every rank reads).

    ``state_dict()`` is a collective (``all_gather_object``): every rank must call it, as
    Accelerate's ``save_state`` and Lightning's checkpointing do. ``load_state_dict`` picks this
    rank's entry. Tensors travel and are saved on the CPU.

    Args:
        state: the hook state to wrap.
    """

    def __init__(self, state: GradzipHookState) -> None:
        if not isinstance(state, GradzipHookState):
            raise TypeError(f"`state` must be a GradzipHookState, got {type(state).__name__}")
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        mine = _tree_to(self.state.state_dict(), torch.device("cpu"))
        group = self.state.process_group
        entries: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(entries, mine, group=group)
        return {_PER_RANK: entries}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.state.load_state_dict(state)


def gradzip_hook(state: GradzipHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average one bucket's gradients through gradzip.

    Args:
        state: a :class:`GradzipHookState`.
        bucket: DDP's bucket of local (not yet averaged) gradients.

    Returns:
        A future holding the bucket's buffer, completed once that buffer holds the averaged
        gradients: at once with ``overlap=False``, by the communication thread otherwise.
    """
    if state.overlap:
        return state._submit(bucket)
    # Synchronous collectives, in bucket order, identical on every rank: see the module
    # docstring for why nothing may wait inside a Future callback.
    state._reduce_bucket(state.engine, state._named_grads(bucket), bucket.is_last())
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _raiser(exc: BaseException) -> Any:
    def fail() -> torch.Tensor:
        raise exc
    return fail


# DDP checks the hook's annotations against the real types; postponed (string) annotations
# would fail that check.
gradzip_hook.__annotations__ = {
    "state": GradzipHookState,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def make_hook(
    model_or_named_params: nn.Module | Iterable[tuple[str, torch.Tensor]],
    compressor: Compressor | str,
    *,
    process_group: dist.ProcessGroup | None = None,
    overlap: bool = True,
    options: EngineOptions | None = None,
    **engine_options: Any,
) -> tuple[GradzipHookState, Any]:
    """The ``(state, hook)`` pair that ``ddp_model.register_comm_hook(state, hook)`` and
    Lightning's ``DDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook)`` take.

    Args:
        model_or_named_params: the module DDP wraps (or the DDP model, or its
            ``(name, parameter)`` pairs).
        compressor: a :class:`~gradzip.Compressor` or spec string such as ``"powersgd:rank=2"``.
        process_group, overlap: see :class:`GradzipHookState`.
        options, **engine_options: an :class:`~gradzip.EngineOptions` and/or its fields as
            keywords (see :class:`~gradzip.EngineOptions`).

    Returns:
        ``(state, gradzip_hook)``.

    Raises:
        TypeError, ValueError: invalid arguments, naming the parameter.
    """
    state = GradzipHookState(
        _named_parameters(model_or_named_params), compressor, process_group=process_group,
        overlap=overlap, options=EngineOptions.build(options, **engine_options),
    )
    return state, gradzip_hook


def register(
    ddp_model: DistributedDataParallel,
    compressor: Compressor | str,
    *,
    process_group: dist.ProcessGroup | None = None,
    overlap: bool = True,
    options: EngineOptions | None = None,
    **engine_options: Any,
) -> GradzipHookState:
    """Register gradzip as ``ddp_model``'s communication hook (before the first backward).

    Args:
        ddp_model: a :class:`~torch.nn.parallel.DistributedDataParallel` model.
        compressor: a :class:`~gradzip.Compressor` or spec string such as ``"topk:ratio=0.01"``.
        process_group: defaults to the group ``ddp_model`` reduces over.
        overlap: see :class:`GradzipHookState`.
        options, **engine_options: an :class:`~gradzip.EngineOptions` and/or its fields as
            keywords (``optimizer``, ``error_feedback``, ``nonfinite``, ``grad_scaler``,
            ``dense_1d``, ``rules``, ``min_numel``; see :class:`~gradzip.EngineOptions`).

    Returns:
        The hook state: ``stats``, ``state_dict()`` (one file per rank), ``load_state_dict()``.

    Raises:
        TypeError, ValueError: invalid arguments, naming the parameter.
        RuntimeError: ``ddp_model`` already has a comm hook (raised by DDP).
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"`ddp_model` must be a torch.nn.parallel.DistributedDataParallel, "
            f"got {type(ddp_model).__name__}"
        )
    options = EngineOptions.build(options, **engine_options)
    if process_group is None:
        process_group = getattr(ddp_model, "process_group", None)
    state, hook = make_hook(
        ddp_model.module, compressor, process_group=process_group, overlap=overlap,
        options=options,
    )
    ddp_model.register_comm_hook(state, hook)
    log.debug("registered gradzip %s on %d parameters", state.compressor.spec(), len(state.params))
    return state
