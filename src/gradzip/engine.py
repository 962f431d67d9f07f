"""The one stateful object a user holds: compress, exchange and average gradients."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from gradzip._validate import check_bool, check_choice
from gradzip.comm.base import Collective, allgather_wire_bytes, allreduce_wire_bytes
from gradzip.comm.torch_dist import default_collective
from gradzip.compressors.base import Compressor, Job, StepContext, dense_reduce
from gradzip.compressors.spec import compressor_from_spec
from gradzip.feedback import compensate
from gradzip.ops.random import stable_hash

__all__ = ["FORMAT_VERSION", "Engine"]

log = logging.getLogger(__name__)
_HALF = (torch.float16, torch.bfloat16)  # summed in fp32, where their range cannot overflow

FORMAT_VERSION = 1
NONFINITE_POLICIES = ("skip", "zero", "raise")


def _copy_tree(tree: Any) -> Any:
    """Copy the dict structure of a state tree, sharing its tensors (they are never mutated)."""
    if isinstance(tree, dict):
        return {k: _copy_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_copy_tree(v) for v in tree]
    return tree


def _first_mismatch(expected: Any, got: Any, path: str) -> str | None:
    """Describe the first difference in structure or tensor shape between two state trees."""
    if isinstance(expected, dict):
        if not isinstance(got, dict):
            return f"{path}: expected a dict, got {type(got).__name__}"
        if set(expected) != set(got):
            missing = sorted(map(str, set(expected) - set(got)))
            extra = sorted(map(str, set(got) - set(expected)))
            return f"{path}: missing keys {missing}, unexpected keys {extra}"
        for key in expected:
            found = _first_mismatch(expected[key], got[key], f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{path}: expected a tensor, got {type(got).__name__}"
        if expected.shape != got.shape:
            return f"{path}: expected shape {tuple(expected.shape)}, got {tuple(got.shape)}"
    return None


class Engine:
    """Compressed gradient averaging with error feedback, for real or simulated workers.

    Args:
        params: the model (its trainable named parameters), an iterable of ``(name, param)``,
            or a mapping ``name -> shape`` (or ``name -> tensor``).
        compressor: a :class:`~gradzip.Compressor`, a spec string such as
            ``"topk:ratio=0.01"``, or an :class:`~gradzip.Accordion`.
        error_feedback: keep and re-add what was not sent; ``None`` follows the compressor
            (on for biased ones: all but none/fp16/bf16/qsgd).
        collective: where workers meet: a :class:`~gradzip.SimulatedGroup` (gradients then
            carry a leading worker axis) or a process group; default the world group, or a
            single worker when ``torch.distributed`` is not initialised.
        nonfinite: what to do when any worker's gradient holds NaN/Inf, decided identically
            on every worker: ``"skip"`` leaves all state as before the step and returns NaN
            gradients, so a ``GradScaler`` (or any finite check) skips the optimizer step;
            ``"zero"`` leaves the state and returns zeros; ``"raise"`` raises
            ``FloatingPointError``.
        optimizer: read for the learning rate (adaptive compressors react to its drops).
        grad_scaler: a ``torch.amp.GradScaler`` whose scaled gradients this engine sees.
            Residuals are kept at the loss scale they were made at; when the scaler changes
            its scale they are multiplied by the ratio (a power of two: exact), so error
            feedback re-adds what was not sent at the right magnitude.
        dense_1d: send tensors of fewer than two dimensions (biases, normalisation weights)
            uncompressed: one exact all-reduce per call, no error feedback, never seen by the
            compressor, as PyTorch's PowerSGD hook and the Accordion reference code do. They
            are few entries in a large model, and compressing them hard costs accuracy.

    Raises:
        TypeError, ValueError: invalid arguments, naming the parameter.

    Example:
        >>> engine = Engine(model, "powersgd:rank=2")
        >>> loss.backward(); engine.reduce_()   # averaged, compressed gradients in .grad
    """

    def __init__(
        self,
        params: nn.Module | Iterable[tuple[str, torch.Tensor]] | Mapping[str, Any],
        compressor: Compressor | str,
        *,
        error_feedback: bool | None = None,
        collective: Collective | None = None,
        nonfinite: str = "skip",
        optimizer: torch.optim.Optimizer | None = None,
        grad_scaler: Any = None,
        dense_1d: bool = False,
    ) -> None:
        self.params: dict[str, torch.Tensor] = {}
        if isinstance(params, nn.Module):
            self.params = {n: p for n, p in params.named_parameters() if p.requires_grad}
            shapes = {n: p.shape for n, p in self.params.items()}
        elif isinstance(params, Mapping):
            shapes = {
                str(n): (v.shape if isinstance(v, torch.Tensor) else torch.Size(v))
                for n, v in params.items()
            }
        elif isinstance(params, Iterable) and not isinstance(params, (str, torch.Tensor)):
            self.params = {str(n): p for n, p in params}
            shapes = {n: p.shape for n, p in self.params.items()}
        else:
            raise TypeError(
                f"`params` must be a module, (name, parameter) pairs or a name->shape mapping, "
                f"got {type(params).__name__}"
            )
        self.compressor = compressor_from_spec(compressor)
        if error_feedback is None:
            error_feedback = bool(getattr(self.compressor, "biased", True))
        self.error_feedback = check_bool("error_feedback", error_feedback)
        self.nonfinite = check_choice("nonfinite", nonfinite, NONFINITE_POLICIES)
        self.dense_1d = check_bool("dense_1d", dense_1d)
        if collective is not None and not isinstance(collective, Collective):
            raise TypeError(
                f"`collective` must be a gradzip Collective, got {type(collective).__name__}"
            )
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"`optimizer` must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if grad_scaler is not None and not callable(getattr(grad_scaler, "get_scale", None)):
            raise TypeError(
                f"`grad_scaler` must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}"
            )
        self.optimizer = optimizer
        self.grad_scaler = grad_scaler
        self.residual_scale: float | None = None
        self.comm = collective if collective is not None else default_collective()
        self.shapes: dict[str, torch.Size] = {n: torch.Size(s) for n, s in shapes.items()}
        self._order = {n: i for i, n in enumerate(self.shapes)}
        self.dense_names = frozenset(n for n, s in self.shapes.items() if dense_1d and len(s) < 2)
        self.step = 0
        self.skipped_steps = 0
        self.dense_payload = [0] * self.comm.local_workers
        self.dense_wire = [0] * self.comm.local_workers
        self.residuals: dict[str, torch.Tensor] = {}
        self.compressor_state = self.compressor.init_state(self._compressed_shapes())
        self._snapshot: tuple[Any, ...] | None = None
        self._poisoned = False
        self._verified = self.comm.simulated or self.comm.world_size == 1
        self.handshake_bytes = 0

    def _compressed_shapes(self) -> dict[str, torch.Size]:
        return {n: s for n, s in self.shapes.items() if n not in self.dense_names}

    # -- context ---------------------------------------------------------------------------
    @property
    def simulated(self) -> bool:
        """Whether gradients carry a leading worker axis (a simulated group)."""
        return self.comm.simulated

    def _context(self) -> StepContext:
        lr = None
        if self.optimizer is not None and self.optimizer.param_groups:
            lr = float(self.optimizer.param_groups[0]["lr"])
        return StepContext(
            step=self.step, ranks=tuple(self.comm.local_ranks), world_size=self.comm.world_size,
            lr=lr,
        )

    def _as_worker_axis(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        if not isinstance(grad, torch.Tensor):
            raise TypeError(f"gradient `{name}` must be a tensor, got {type(grad).__name__}")
        if name not in self.shapes:
            raise ValueError(
                f"gradient names must be parameters of this engine, got unknown name {name!r}"
            )
        want = self.shapes[name]
        if self.simulated:
            expected = torch.Size((self.comm.local_workers, *want))
            if grad.shape != expected:
                raise ValueError(
                    f"gradient `{name}` must have shape {tuple(expected)} (workers first), "
                    f"got {tuple(grad.shape)}"
                )
            return grad
        if grad.shape != want:
            raise ValueError(f"gradient `{name}` must have shape {tuple(want)}, got {tuple(grad.shape)}")
        return grad.unsqueeze(0)

    # -- agreement across ranks -------------------------------------------------------------
    def _fingerprint(self) -> dict[str, str]:
        return {
            "compressor": self.compressor.spec(),
            "error_feedback": str(self.error_feedback),
            "nonfinite": self.nonfinite,
            "dense_1d": str(self.dense_1d),
            "parameters": ";".join(f"{n}:{tuple(s)}" for n, s in sorted(self.shapes.items())),
        }

    def _verify_agreement(self) -> None:
        """Check once that every rank runs the same configuration on the same parameters.

        Ranks that disagree would issue collectives of different sizes and hang or average
        garbage; a fingerprint gathered before the first step turns that into an error naming
        what differs. Its bytes are counted in ``stats["handshake_bytes"]``, apart from the
        gradient traffic.
        """
        fields = self._fingerprint()
        codes = [stable_hash(v) for v in fields.values()]
        mine = torch.tensor([codes], dtype=torch.int64)
        theirs = self.comm.all_gather(mine, metered=False)  # [W, fields]
        self.handshake_bytes += allgather_wire_bytes(mine.numel() * 8, self.comm.world_size)
        self._verified = True
        for col, (key, value) in enumerate(fields.items()):
            column = theirs[:, col].tolist()
            if len(set(column)) > 1:
                odd = next(r for r, c in enumerate(column) if c != column[self.comm.first_rank])
                raise ValueError(
                    f"ranks disagree on `{key}`: rank {self.comm.first_rank} has {value!r}, "
                    f"rank {odd} has a different value; every rank must build the engine with "
                    f"the same compressor, options and parameters"
                )

    # -- the step --------------------------------------------------------------------------
    def _protects_state(self) -> bool:
        return self.error_feedback or bool(self.compressor_state)

    def _any_nonfinite(self, grads: list[torch.Tensor]) -> bool:
        workers = self.comm.local_workers
        local = torch.zeros(workers, 1)
        if grads:
            # A sum is finite whenever every entry is (NaN and Inf propagate through it), so
            # one summing pass per tensor clears the usual case, about 40x faster than an
            # elementwise test; a sum that is not finite (a NaN or Inf entry, or finite
            # entries whose sum overflows) is settled by the exact elementwise test.
            rows = [g.reshape(workers, -1) for g in grads]
            sums = torch.stack([
                r.sum(dim=1, dtype=torch.float32 if r.dtype in _HALF else None).float()
                for r in rows
            ], dim=1)  # [L, T]
            for w, t in torch.nonzero(~torch.isfinite(sums)).tolist():
                if not bool(torch.isfinite(rows[t][w]).all()):
                    local[w] = 1.0
        # Summed over workers, so every worker takes the same branch.
        return float(self.comm.all_reduce(local).item()) > 0

    def reduce(
        self, named_grads: Mapping[str, torch.Tensor], *, finish_step: bool = True
    ) -> dict[str, torch.Tensor]:
        """Average gradients over all workers through the compressor.

        Args:
            named_grads: ``name -> gradient`` (with a leading worker axis in a simulated
                group). Not modified.
            finish_step: whether this call completes an optimizer step (a DDP hook passes
                ``False`` for every bucket but the last).

        Returns:
            ``name -> averaged gradient`` in each gradient's dtype, identical on all workers.

        Raises:
            ValueError: unknown names or wrong shapes.
            FloatingPointError: a non-finite gradient with ``nonfinite="raise"``.
        """
        if not isinstance(named_grads, Mapping):
            raise TypeError(f"`named_grads` must be a mapping name -> tensor, got {type(named_grads).__name__}")
        # The engine's own parameter order, not the caller's: DDP hands a bucket's tensors in
        # an order that changes when it rebuilds its buckets, and the layout of the flat
        # buffers decides which worker adds which element first in a ring all-reduce. A fixed
        # layout keeps a resumed run bit-identical to an uninterrupted one.
        names = sorted(named_grads, key=lambda n: self._order.get(n, -1))
        grads = [self._as_worker_axis(n, named_grads[n]) for n in names]
        if not self._verified:
            self._verify_agreement()
        if self._snapshot is None:
            self._follow_loss_scale()
            self._snapshot = (_copy_tree(self.compressor_state), dict(self.residuals))
        if self._poisoned or (self._protects_state() and self._any_nonfinite(grads)):
            out = self._handle_nonfinite(names, named_grads)
        else:
            out = self._reduce_finite(names, grads, named_grads)
        if finish_step:
            self._finish_step()
        return out

    def _follow_loss_scale(self) -> None:
        """Bring residuals to the scaler's current loss scale (at the start of a step)."""
        if self.grad_scaler is None or not self.grad_scaler.is_enabled():
            return
        scale = float(self.grad_scaler.get_scale())
        if self.residual_scale is not None and scale != self.residual_scale:
            ratio = scale / self.residual_scale
            self.residuals = {n: r * ratio for n, r in self.residuals.items()}
        self.residual_scale = scale

    def _reduce_finite(
        self, names: list[str], grads: list[torch.Tensor], named_grads: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        workers, world = self.comm.local_workers, self.comm.world_size
        jobs, dense = [], []
        for name, g in zip(names, grads, strict=True):
            if name in self.dense_names:
                dense.append(Job(name, g.to(torch.float32)))
            else:
                residual = self.residuals.get(name) if self.error_feedback else None
                # raw: the gradient before error feedback, for controllers that judge the
                # training regime from it (Accordion); a reference, no copy.
                jobs.append(Job(name, compensate(g, residual), raw=g))
        dense_reduce(dense, self.comm)
        if jobs:
            self.compressor.reduce(jobs, self.compressor_state, self.comm, self._context())
        dense_bytes = 4 * sum(j.numel for j in jobs + dense)
        for w in range(workers):
            self.dense_payload[w] += dense_bytes
            self.dense_wire[w] += allreduce_wire_bytes(dense_bytes, world)
        out = {}
        for job in jobs:
            assert job.averaged is not None, job.name
            if self.error_feedback:
                self.residuals[job.name] = job.leftover()
        for job in jobs + dense:
            out[job.name] = job.averaged.to(named_grads[job.name].dtype)  # type: ignore[union-attr]
        return {n: out[n] for n in names}

    def _handle_nonfinite(
        self, names: list[str], named_grads: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        if self.nonfinite == "raise":
            raise FloatingPointError(
                f"a gradient holds NaN or Inf at step {self.step} (on at least one worker); "
                f"tensors in this call: {names[:5]}{'...' if len(names) > 5 else ''}"
            )
        if not self._poisoned:
            log.warning("non-finite gradient at step %d: step skipped, state kept", self.step)
        self._poisoned = True
        fill = float("nan") if self.nonfinite == "skip" else 0.0
        return {
            n: torch.full(self.shapes[n], fill, dtype=named_grads[n].dtype, device=named_grads[n].device)
            for n in names
        }

    def _finish_step(self) -> None:
        ctx = self._context()
        if self._poisoned:
            # Roll every piece of state back to where the step started.
            assert self._snapshot is not None
            self.compressor_state, self.residuals = self._snapshot
            self.skipped_steps += 1
        else:
            self.compressor.end_step(self.compressor_state, ctx)
        self.step += 1
        self._snapshot = None
        self._poisoned = False

    def reduce_(self) -> None:
        """Replace ``.grad`` of the engine's parameters by the averaged, compressed gradients.

        Parameters without a gradient are skipped (every worker must skip the same ones).

        Raises:
            RuntimeError: the engine was built from shapes, or holds simulated workers.
        """
        if not self.params or self.simulated:
            raise RuntimeError(
                "reduce_() needs an engine built from parameters in a real (one worker per "
                "process) group; use reduce() with named gradients otherwise"
            )
        grads = {n: p.grad for n, p in self.params.items() if p.grad is not None}
        for name, avg in self.reduce(grads).items():
            self.params[name].grad.copy_(avg)

    # -- observability ---------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, Any]:
        """Cumulative counters: steps, skipped steps, payload and wire bytes per local worker
        (and what a dense fp32 all-reduce would have cost)."""
        meter = self.comm.meter
        return {
            "steps": self.step,
            "skipped_steps": self.skipped_steps,
            "payload_bytes": list(meter.payload),
            "wire_bytes": list(meter.wire),
            "dense_payload_bytes": list(self.dense_payload),
            "dense_wire_bytes": list(self.dense_wire),
            "collective_calls": meter.calls,
            "handshake_bytes": self.handshake_bytes,
        }

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly: tensors and plain values only.

        Residuals belong to the workers of this process: save one file per rank.
        """
        if self._snapshot is not None:
            raise RuntimeError("state_dict() must be called between steps, not inside one")
        return {
            "format_version": FORMAT_VERSION,
            "compressor": self.compressor.spec(),
            "error_feedback": self.error_feedback,
            "dense_1d": self.dense_1d,
            "world_size": self.comm.world_size,
            "ranks": list(self.comm.local_ranks),
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "residual_scale": self.residual_scale,
            "residuals": {n: r.clone() for n, r in self.residuals.items()},
            "compressor_state": _copy_tree(self.compressor_state),
            "meter": self.comm.meter.snapshot(),
            "dense_payload": list(self.dense_payload),
            "dense_wire": list(self.dense_wire),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output, validating it first.

        Raises:
            ValueError: another format version, compressor, world size, rank, or a name or
                shape that does not match (the first mismatch is named).
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"`state` must be a mapping, got {type(state).__name__}")
        if state.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"`format_version` must be {FORMAT_VERSION}, got {state.get('format_version')!r}"
            )
        checks = {
            "compressor": self.compressor.spec(),
            "error_feedback": self.error_feedback,
            "world_size": self.comm.world_size,
            "ranks": list(self.comm.local_ranks),
        }
        if state.get("dense_1d", False) != self.dense_1d:  # absent from older checkpoints
            raise ValueError(
                f"`dense_1d` of the checkpoint must be {self.dense_1d!r}, got {state.get('dense_1d')!r}"
            )
        for key, want in checks.items():
            if state.get(key) != want:
                raise ValueError(f"`{key}` of the checkpoint must be {want!r}, got {state.get(key)!r}")
        for name, res in state["residuals"].items():
            expected = torch.Size((self.comm.local_workers, *self.shapes.get(name, ())))
            if name not in self.shapes or res.shape != expected:
                raise ValueError(
                    f"residual {name!r} must match a parameter of shape {tuple(expected)}, "
                    f"got {tuple(res.shape)}"
                )
            if name in self.dense_names:
                raise ValueError(f"residual {name!r} must be absent: it is sent dense (`dense_1d`)")
        mismatch = _first_mismatch(
            self.compressor.init_state(self._compressed_shapes()), state["compressor_state"],
            "compressor_state"
        )
        if mismatch:
            raise ValueError(f"checkpoint does not match this engine: {mismatch}")
        self.step = int(state["step"])
        self.skipped_steps = int(state["skipped_steps"])
        scale = state.get("residual_scale")
        self.residual_scale = None if scale is None else float(scale)
        self.residuals = {n: r.clone() for n, r in state["residuals"].items()}
        self.compressor_state = _copy_tree(state["compressor_state"])
        self.comm.meter.load(state["meter"])
        self.dense_payload = list(state["dense_payload"])
        self.dense_wire = list(state["dense_wire"])
        self._snapshot = None
        self._poisoned = False
