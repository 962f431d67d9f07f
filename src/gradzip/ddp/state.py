"""The state behind gradzip's DDP comm hook: one engine, the buckets' work, checkpoints.

See :mod:`gradzip.ddp` for why the hook is shaped as it is; the hook functions and
``register`` live in :mod:`gradzip.ddp.hook`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from gradzip._validate import check_bool
from gradzip.comm.torch_dist import ProcessGroupCollective
from gradzip.compressors.base import Compressor
from gradzip.ddp.fused import FusedBuckets
from gradzip.ddp.gate import StepGate
from gradzip.ddp.gathered import GatheredState, rank_entry
from gradzip.ddp.params import named_trainable_parameters, tree_to
from gradzip.ddp.thread import comm_thread, private_group
from gradzip.engine import STATS_KEYS, BucketLayout, Engine
from gradzip.engine.routing import idle_rule
from gradzip.options import EngineOptions
from gradzip.spec import compressor_from_spec

__all__ = ["GatheredState", "GradzipHookState"]

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
            later buckets (the default); ``False`` runs it inside the hook, synchronously. On
            CUDA with NCCL, a compressor that decides on the device runs inside the hook either
            way: its collectives are asynchronous already (``gradzip.ddp.hook.runs_inline``).
        fuse_buckets: keep every bucket of a backward pass and average them all in one engine
            call at the last one (:mod:`gradzip.ddp.fused`): a step's fixed per-call work is
            paid once instead of once per bucket, for no overlap with the backward pass and
            one more gradient-sized buffer. ``overlap`` then does not apply.

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
        fuse_buckets: bool = False,
        **engine_options: Any,
    ) -> None:
        pairs = named_trainable_parameters(named_params)
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
        self.fuse_buckets = check_bool("fuse_buckets", fuse_buckets)
        self._fused = FusedBuckets() if fuse_buckets else None
        self.process_group = process_group
        self.params: dict[str, torch.Tensor] = dict(pairs)
        # The engine is built at the first bucket; a rule that decides nothing is refused now.
        idle = idle_rule({n: p.shape for n, p in pairs}, options)
        if idle:
            raise ValueError(idle)
        # Identity of the parameter objects (DDP hands back the very same objects).
        self._name_of: dict[int, str] = {id(p): n for n, p in pairs}
        self._engine: Engine | None = None
        self._pending: Mapping[str, Any] | None = None
        # Overlap mode: the first error of a bucket's work (sticky: once one bucket failed,
        # the ranks' sequences of collectives no longer match), and whether the engine
        # talks on the communication thread's private group yet.
        self._failure: BaseException | None = None
        self._private_group = False
        # Bucket index -> (identity of its parameters and buffer, the engine's layout of it).
        self._layouts: dict[int, tuple[Any, BucketLayout]] = {}
        # Whether the engine is inside a step; readers wait for it to close (see ddp.gate).
        self._gate = StepGate()
        self._hook_thread: int | None = None  # the thread DDP calls the hook on
        self._inline: bool | None = None  # overlap without the thread (NCCL; ddp.hook)
        # Optimizer steps taken since this state was built (None: no optimizer known). Why:
        # the engine's own step count advances with every reduction on every rank alike, so
        # a rank that runs one backward more than the others (a retried batch) and one fewer
        # later stays "in step" by that count while its replica drifts. Its count of
        # optimizer steps per reduction differs from the others', and every call's header
        # carries it, so such a rank is caught at its next reduction, on every rank.
        self._optimizer_steps: int | None = None
        if options.optimizer is not None:
            self._optimizer_steps = 0
            _count_steps_of(options.optimizer, self)

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
                self._load(pending)
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
    def _layout(self, engine: Engine, bucket: dist.GradBucket) -> BucketLayout:
        """The bucket's layout, built once and reused while the bucket holds the same
        parameters in the same buffer (DDP rebuilds its buckets after the first iteration)."""
        params, buffer = bucket.parameters(), bucket.buffer()
        # Identity of the parameters and of the buffer: a cached layout keeps views of the
        # buffer it was built for, so that storage stays alive and no other buffer can
        # start at the same address while the cache holds it.
        key = (buffer.data_ptr(), buffer.numel(), tuple(id(p) for p in params))
        cached = self._layouts.get(bucket.index())
        if cached is not None and cached[0] == key:
            return cached[1]
        grads = bucket.gradients()  # views into bucket.buffer()
        named = {self.name_of(p): g for p, g in zip(params, grads, strict=True)}
        layout = engine.bucket_layout(named, buffer)
        self._layouts[bucket.index()] = (key, layout)
        if bucket.is_last():  # fewer buckets than before the rebuild: drop the others' views
            for index in [i for i in self._layouts if i > bucket.index()]:
                del self._layouts[index]
        return layout

    def _reduce_bucket(self, engine: Engine, layout: BucketLayout, finish_step: bool,
                       step: int | None) -> None:
        self._gate.open()  # waits while a reader holds the state (see gradzip.ddp.gate)
        try:
            # DDP checked at construction that every rank holds the same parameters and
            # hands every rank the same buckets in the same order (rebuilt buckets follow
            # rank 0's order), so the payload's layout is identical on every rank: the header
            # may ride in it (see gradzip.comm.header).
            engine.reduce_bucket(layout, finish_step=finish_step, step=step)
        except BaseException:
            self._gate.close()  # the engine abandoned the step, its state as before it
            raise
        if finish_step:
            self._gate.close()

    @contextmanager
    def _between_steps(self, *, counters: bool = False) -> Iterator[None]:
        """Wait for the work in flight and for the engine's step to close, then hold the next
        step off while the caller reads or writes the state (see
        :meth:`~gradzip.ddp.gate.StepGate.between_steps`)."""
        self.wait()
        with self._gate.between_steps(self._hook_thread, counters=counters):
            yield

    def _submit(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Queue one bucket's work on the communication thread (``overlap=True``)."""
        buffer = bucket.buffer()
        worker = comm_thread()
        self._hook_thread = threading.get_ident()
        try:
            if self._failure is not None:
                raise self._failed()
            engine = self.engine
            if not self._private_group:
                # Every member reaches its first bucket in the same order: the one moment
                # all of them can make the thread's group together.
                comm = engine.comm
                assert isinstance(comm, ProcessGroupCollective)  # built so by ``engine``
                comm.group = private_group(self.process_group)
                self._private_group = True
            layout = self._layout(engine, bucket)
            finish_step = bucket.is_last()
            # Read now, on the thread that runs the backward pass: the optimizer steps on
            # that thread once the backward (and so this bucket's work) has finished.
            step = self._optimizer_steps
        except BaseException as exc:  # noqa: BLE001 - reported through the future
            self._failure = self._failure or exc
            return worker.submit(_raiser(exc), buffer.device)

        def work() -> torch.Tensor:
            if self._failure is not None:
                raise self._failed()
            try:
                self._reduce_bucket(engine, layout, finish_step, step)
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
        """This rank's cumulative counters (the engine's, as plain ints; see
        :mod:`gradzip.ddp` for the byte counts), plus ``compression_rate`` (dense wire bytes / wire
        bytes, ``None`` before any byte is sent) and ``levels`` (``report(state)["levels"]`` of
        the compressor when it reports one, e.g. an Accordion, else ``None``)."""
        with self._between_steps(counters=True):
            if self._engine is None:
                # The same keys as once the engine exists (zeros: nothing was sent yet).
                return {**dict.fromkeys(STATS_KEYS, 0), "compression_rate": None,
                        "levels": None}
            raw = self._engine.stats
            levels = self._levels()
        out: dict[str, Any] = {
            key: (value[0] if isinstance(value, list) else value) for key, value in raw.items()
        }
        out["compression_rate"] = (
            out["dense_wire_bytes"] / out["wire_bytes"] if out["wire_bytes"] else None
        )
        out["levels"] = levels
        return out

    def _levels(self) -> Any:
        # Adaptive compressors report their current choice (``report(state)["levels"]``);
        # others have none. With rules, the choices of every compressor that reports one are
        # merged (their tensors' names differ).
        engine = self._engine
        if engine is None:
            return None
        pairs = [(self.compressor, engine.compressor_state)] + [
            (c, s) for c, s in zip(engine.rule_compressors, engine.rule_states, strict=True)
            if c is not None
        ]
        found = None
        for compressor, state in pairs:
            levels = compressor.report(state).get("levels")
            if levels is not None:
                found = {**(found or {}), **levels}
        return found

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state (tensors and plain values): save one file per rank.

        Safe from any thread: a call made while a step runs (a background checkpoint thread)
        waits for the step to end and returns one step's state, whole.

        Raises:
            RuntimeError: called inside a step on the thread that runs it, or before the
                process group exists with nothing loaded.
        """
        with self._between_steps():
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
        with self._between_steps():
            self._load(state)

    def _load(self, state: Mapping[str, Any]) -> None:
        if self._engine is None and not dist.is_initialized():
            self._pending = state
            return
        engine = self.engine
        state = rank_entry(state, engine.comm.first_rank, engine.comm.world_size)
        device = next(iter(self.params.values())).device
        engine.load_state_dict(tree_to(state, device))

    def gathered(self) -> GatheredState:
        """A view whose checkpoints hold every rank's state, for frameworks where one process
        writes the checkpoint (Accelerate's ``register_for_checkpointing``, Lightning)."""
        return GatheredState(self)

    def __repr__(self) -> str:
        # Never waits, never builds the engine, needs no process group: a repr may be asked
        # for anywhere (a debugger, a log line inside a step, before init_process_group).
        if self._engine is not None:
            where = f"steps={self._engine.step}"
            if self._gate.is_open:
                where += " (a step in progress)"
        elif self._pending is not None:
            where = (f"engine=None (built with the process group; a checkpoint at step "
                     f"{self._pending.get('step', '?')} waits to be loaded)")
        else:
            where = "engine=None (built at the first bucket, once the process group exists)"
        fused = ", fuse_buckets=True" if self.fuse_buckets else ""
        return (f"GradzipHookState(compressor={self.compressor.spec()!r}, "
                f"parameters={len(self.params)}, overlap={self.overlap}{fused}, {where})")


def _count_steps_of(optimizer: torch.optim.Optimizer, state: GradzipHookState) -> None:
    """Count ``optimizer``'s steps in ``state._optimizer_steps`` (a step post-hook holding
    the state weakly, so the optimizer does not keep a discarded state alive)."""
    ref = weakref.ref(state)
    # Wrappers (Accelerate's AcceleratedOptimizer) subclass Optimizer without its hook
    # registry and step the optimizer they hold: count that one's steps.
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer

    def count(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
        target = ref()
        if target is not None and target._optimizer_steps is not None:
            target._optimizer_steps += 1

    optimizer.register_step_post_hook(count)


def _raiser(exc: BaseException) -> Any:
    def fail() -> torch.Tensor:
        raise exc
    return fail
