"""DistributedDataParallel communication hook: gradzip's engine behind DDP's buckets.

A thin adapter: :mod:`~gradzip.ddp.hook` (the hook, ``make_hook`` and ``register``),
:mod:`~gradzip.ddp.state` (:class:`GradzipHookState`: one engine, the buckets' work,
checkpoints), :mod:`~gradzip.ddp.fused` (``fuse_buckets``: a step's buckets in one engine
call), :mod:`~gradzip.ddp.gate` (readers of the state wait for the step to close),
:mod:`~gradzip.ddp.gathered` (every rank's state in one checkpoint),
:mod:`~gradzip.ddp.thread` (the communication thread and its private group) and
:mod:`~gradzip.ddp.params` (a model's trainable parameters, state trees moved between
devices). DDP hands the hook one *bucket* (a flat buffer holding several parameters'
local gradients) at a time; the hook looks the parameters up by name, lets one
:class:`~gradzip.Engine` average them through the compressor, writes the averages back into
the bucket's buffer and completes the future it returned. By default (``overlap=True``) that
work runs on a communication thread while autograd computes the later buckets, as native DDP
overlaps its all-reduces; ``overlap=False`` runs it inside the hook (the baseline, and the
simplest to debug). Both give the same results bit for bit. On CUDA with NCCL, a compressor
that decides on the device runs inside the hook either way (:func:`~gradzip.ddp.hook.runs_inline`):
its collectives are asynchronous already, so the thread would add nothing but contention.

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
  private copy of the process group (see :mod:`gradzip.ddp.thread` for why a copy); with
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

Examples:
    >>> ddp_model = DistributedDataParallel(model)
    >>> state = gradzip.ddp.register(ddp_model, "powersgd:rank=2", optimizer=optimizer)
    >>> ...train...; torch.save(state.state_dict(), f"gradzip-rank{rank}.pt")
"""

from gradzip.ddp.hook import gradzip_hook, make_hook, register
from gradzip.ddp.state import GatheredState, GradzipHookState

__all__ = ["GatheredState", "GradzipHookState", "gradzip_hook", "make_hook", "register"]
