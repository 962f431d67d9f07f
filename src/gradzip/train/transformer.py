"""A small decoder-only transformer for the ``lm`` task (written here; nothing downloaded)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradzip._validate import check_int, check_real

__all__ = ["TransformerLanguageModel"]


class _Block(nn.Module):
    """Pre-norm block: causal self-attention, then a 4x GELU MLP, each with a residual."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(dim, dim=2)
        q, k, v = (t.view(batch, length, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        att = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(batch, length, dim)))
        return x + self.drop(self.mlp(self.norm2(x)))


class TransformerLanguageModel(nn.Module):
    """Token and learned position embeddings, ``layers`` causal blocks, a final norm and a
    decoder tied to the token embedding.

    The ``lm`` task's interface: ``forward(input [T, B], state) -> (logits [T, B, V], state)``
    with an empty state (each window is attended on its own; nothing is carried).
    """

    def __init__(self, vocab_size: int, dim: int = 128, layers: int = 2, heads: int = 4,
                 context: int = 256, dropout: float = 0.1) -> None:
        """Build the model.

        Args:
            vocab_size: number of tokens.
            dim: model width (a multiple of ``heads``).
            layers: transformer blocks.
            heads: attention heads.
            context: the longest window (positions embedded).
            dropout: dropout in [0, 1) on attention, residual branches and embeddings.

        Raises:
            TypeError, ValueError: an argument out of range, naming it.
        """
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("dim", dim), ("layers", layers),
                            ("heads", heads), ("context", context)):
            check_int(name, value, minimum=1)
        if dim % heads:
            raise ValueError(f"`dim` must be a multiple of heads={heads}, got {dim}")
        dropout = check_real("dropout", dropout, low=0, high=1, high_open=True)
        self.context = context
        self.embed = nn.Embedding(vocab_size, dim)
        self.position = nn.Embedding(context, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_Block(dim, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)

    def init_hidden(self, batch_size: int) -> tuple[Tensor, ...]:
        """The (empty) state the ``lm`` task carries between windows."""
        check_int("batch_size", batch_size, minimum=1)
        return ()

    def forward(self, input: Tensor, hidden: tuple[Tensor, ...] | None = None) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Logits of the next token at every position.

        Args:
            input: token ids ``[T, B]`` with ``T <= context``.
            hidden: ignored (the empty state).

        Returns:
            ``(logits [T, B, vocab_size], ())``.

        Raises:
            ValueError: ``input`` is not 2-D or longer than the context.
        """
        if input.dim() != 2 or input.shape[0] > self.context:
            raise ValueError(f"`input` must be a 2-D tensor [T, B] with T <= {self.context}, "
                             f"got shape {tuple(input.shape)}")
        tokens = input.t()  # [B, T]
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.embed(tokens) + self.position(positions))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.norm(x), self.embed.weight)  # decoder tied to the embedding
        return logits.transpose(0, 1), ()
