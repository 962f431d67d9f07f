"""The language-model task: a text corpus, a 2-layer LSTM (or a small decoder-only
transformer), truncated BPTT, perplexity."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradzip.train import data as D
from gradzip.train import text as T
from gradzip.train.tasks.base import Defaults, Task, data_option, new_model

__all__ = ["TASK", "LanguageModelTask"]


class LanguageModelTask(Task):
    """Word- (or char-) level language modelling with an LSTM; truncated BPTT; perplexity.

    The training stream is cut into ``world`` contiguous parts, one per worker, each arranged
    in ``batch_size`` columns; every epoch walks the windows in order with the hidden state
    carried across windows (reset at the start of each epoch).
    """

    def load(self, cfg: Any) -> D.LMData:
        with data_option():
            lm = T.load_text(cfg.data, level=cfg.text_level)
        if cfg.limit_train is not None:
            lm.train_ids = lm.train_ids[: cfg.limit_train]
        return lm

    def build_model(self, cfg: Any, data: Any) -> nn.Module:
        return new_model(cfg.model, len(data.vocab), cfg.seed)

    def _stream(self, data: D.LMData, cfg: Any, world: int, rank: int) -> Tensor:
        per = len(data.train_ids) // world
        return T.batchify(data.train_ids[rank * per:(rank + 1) * per], cfg.batch_size)

    def steps_per_epoch(self, data: Any, cfg: Any, world: int) -> int:
        per = len(data.train_ids) // world
        if per // cfg.batch_size < 2:
            raise ValueError(
                f"`batch_size` must leave at least 2 tokens per column of each worker's "
                f"{per} tokens, got {cfg.batch_size}"
            )
        return math.ceil((per // cfg.batch_size - 1) / cfg.bptt)

    def batches(self, data: Any, cfg: Any, world: int, rank: int, epoch: int) -> list[Any]:
        return list(T.bptt_batches(self._stream(data, cfg, world, rank), cfg.bptt))

    def init_carry(self, model: nn.Module, cfg: Any) -> Any:
        return model.init_hidden(cfg.batch_size)  # type: ignore[operator]

    def loss(self, model: nn.Module, batch: Any, carry: Any) -> tuple[Tensor, Any]:
        inp, tgt = batch
        logits, hidden = model(inp, carry)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        # Truncated BPTT: the next window starts from this state without its history. (The
        # model may be wrapped in DDP, so no model method is used here.)
        return loss, tuple(h.detach() for h in hidden)

    @torch.no_grad()
    def eval_sums(self, model: nn.Module, data: Any, cfg: Any, world: int, rank: int) -> Tensor:
        per = len(data.valid_ids) // world
        part = data.valid_ids[rank * per:(rank + 1) * per]
        sums = torch.zeros(3, dtype=torch.float64)
        columns = max(1, min(10, len(part) // 2))
        if len(part) < 2:
            return sums
        stream = T.batchify(part, columns).to(next(model.parameters()).device)
        hidden = model.init_hidden(columns)  # type: ignore[operator]
        for inp, tgt in T.bptt_batches(stream, cfg.bptt):
            logits, hidden = model(inp, hidden)
            sums[0] += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             tgt.reshape(-1), reduction="sum"))
            sums[2] += tgt.numel()
        return sums

    def metrics(self, sums: Tensor) -> dict[str, float]:
        loss = float(sums[0]) / max(float(sums[2]), 1.0)
        return {"test_loss": loss, "perplexity": math.exp(min(loss, 50.0))}


#: The task with its defaults and the models it accepts.
TASK = LanguageModelTask(
    "lm", "language model on a text file or dir (--data), 2-layer LSTM, perplexity",
    Defaults(model="lstm", epochs=90, batch_size=20, lr=1.25, momentum=0.0,
             warmup_epochs=5.0, milestones=(60.0, 80.0), interval_epochs=5.0,
             clip=0.25),
    metric="perplexity", needs_data=True, models=("lstm", "transformer"),
)
