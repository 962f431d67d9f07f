"""Text corpora for language modelling: loading, vocabulary, batchifying and BPTT windows."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from gradzip._validate import check_choice, check_int, check_real
from gradzip.train.data import LMData, PathLike, _check_path, _read_utf8

__all__ = ["EOS", "UNK", "batchify", "bptt_batches", "load_text"]

UNK, EOS = "<unk>", "<eos>"


def _text_parts(path: Path, valid_fraction: float) -> tuple[str, str]:
    if path.is_dir():
        found = {}
        for key in ("train", "valid"):
            hits = sorted(p for p in path.iterdir() if p.is_file() and key in p.name)
            if len(hits) != 1:
                names = [p.name for p in hits]
                raise ValueError(f"`path` must hold exactly one *{key}* file, got {names}")
            found[key] = _read_utf8("path", hits[0])
        return found["train"], found["valid"]
    text = _read_utf8("path", path)
    lines = text.splitlines(keepends=True)
    if len(lines) >= 2:
        cut = min(len(lines) - 1, max(1, round(len(lines) * (1 - valid_fraction))))
        return "".join(lines[:cut]), "".join(lines[cut:])
    cut = max(1, round(len(text) * (1 - valid_fraction)))
    return text[:cut], text[cut:]


def _tokenize(text: str, level: str) -> list[str]:
    if level == "char":
        return list(text)
    tokens: list[str] = []
    for line in text.splitlines():
        tokens.extend(line.split())
        tokens.append(EOS)
    return tokens


def load_text(path: PathLike, level: str = "word", valid_fraction: float = 0.1) -> LMData:
    """Load a text corpus for language modelling.

    A file is split by lines: the last ``valid_fraction`` of lines become the
    validation part. A directory must hold one file with ``train`` and one
    with ``valid`` in its name (e.g. ``ptb.train.txt``, ``ptb.valid.txt``).
    Word level splits on whitespace and appends ``<eos>`` to every line; char
    level keeps every character, newlines included. The vocabulary comes
    from the train part (``<unk>`` first, then by decreasing frequency).

    Args:
        path: Text file or directory.
        level: ``"word"`` or ``"char"``.
        valid_fraction: Validation fraction for a single file, in (0, 1).

    Returns:
        LMData with int64 id tensors and the vocabulary list.

    Raises:
        TypeError: If ``path`` is not path-like.
        ValueError: If an argument is invalid or a part holds no tokens.
    """
    src = _check_path("path", path)
    level = check_choice("level", level, ("word", "char"))
    valid_fraction = check_real("valid_fraction", valid_fraction, low=0, high=1,
                                low_open=True, high_open=True)
    train_text, valid_text = _text_parts(src, valid_fraction)
    train_tokens, valid_tokens = _tokenize(train_text, level), _tokenize(valid_text, level)
    if not train_tokens or not valid_tokens:
        raise ValueError(f"`path` must give non-empty train and valid parts, got {str(src)!r}")
    counts = Counter(train_tokens)
    counts.pop(UNK, None)
    vocab = [UNK] + sorted(counts, key=lambda t: (-counts[t], t))
    index = {tok: i for i, tok in enumerate(vocab)}

    def encode(tokens: list[str]) -> Tensor:
        return torch.tensor([index.get(t, 0) for t in tokens], dtype=torch.long)

    return LMData(encode(train_tokens), encode(valid_tokens), vocab)


def batchify(ids: Tensor, batch_size: int) -> Tensor:
    """Arrange a 1-D token stream into ``batch_size`` columns.

    Args:
        ids: 1-D tensor of token ids.
        batch_size: Number of parallel streams.

    Returns:
        Tensor [T, batch_size] with T = len(ids) // batch_size (tail dropped).

    Raises:
        TypeError: If ``ids`` is not a tensor.
        ValueError: If ``ids`` is not 1-D or too short for one row.
    """
    if not isinstance(ids, Tensor):
        raise TypeError(f"`ids` must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dim() != 1:
        raise ValueError(f"`ids` must be a 1-D tensor, got shape {tuple(ids.shape)}")
    batch_size = check_int("batch_size", batch_size, minimum=1)
    steps = ids.numel() // batch_size
    if steps == 0:
        raise ValueError(f"`batch_size` must be <= len(ids)={ids.numel()}, got {batch_size}")
    return ids[: steps * batch_size].view(batch_size, steps).t().contiguous()


def bptt_batches(data: Tensor, bptt: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Iterate over truncated-BPTT windows of a batchified stream.

    Args:
        data: Tensor [T, B] from :func:`batchify`.
        bptt: Window length.

    Returns:
        Iterator of (input, target) pairs, each [L, B] with L <= bptt, where
        target is input shifted one step ahead.

    Raises:
        TypeError: If ``data`` is not a tensor.
        ValueError: If ``data`` is not 2-D or ``bptt`` < 1.
    """
    if not isinstance(data, Tensor):
        raise TypeError(f"`data` must be a torch.Tensor, got {type(data).__name__}")
    if data.dim() != 2:
        raise ValueError(f"`data` must be a 2-D tensor [T, B], got shape {tuple(data.shape)}")
    bptt = check_int("bptt", bptt, minimum=1)

    def gen() -> Iterator[tuple[Tensor, Tensor]]:
        for start in range(0, data.shape[0] - 1, bptt):
            length = min(bptt, data.shape[0] - 1 - start)
            yield data[start:start + length], data[start + 1:start + 1 + length]

    return gen()
