"""The small decoder-only transformer of the ``lm`` task."""

from __future__ import annotations

import pytest
import torch

from gradzip.train.tasks.base import new_model
from gradzip.train.transformer import TransformerLanguageModel


def test_shapes_state_and_causality() -> None:
    model = new_model("transformer:dim=16,layers=2,heads=2,dropout=0", 50, seed=0).eval()
    assert isinstance(model, TransformerLanguageModel)
    tokens = torch.randint(0, 50, (7, 3), generator=torch.Generator().manual_seed(0))
    logits, state = model(tokens, model.init_hidden(3))
    assert logits.shape == (7, 3, 50) and state == ()
    changed = tokens.clone()
    changed[5:] = (changed[5:] + 1) % 50  # a later token cannot change earlier predictions
    later, _ = model(changed)
    assert torch.equal(later[:5], logits[:5])
    assert not torch.equal(later[5:], logits[5:])
    # The decoder is the embedding: no separate output matrix.
    assert sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for n, p in model.named_parameters())
    assert all("decoder" not in n for n, _ in model.named_parameters())


def test_same_seed_same_weights_and_bad_arguments() -> None:
    a = new_model("transformer:dim=16,layers=1,heads=2", 20, seed=3)
    b = new_model("transformer:dim=16,layers=1,heads=2", 20, seed=3)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    with pytest.raises(ValueError, match="`dim` must be a multiple of heads=3, got 16"):
        TransformerLanguageModel(20, dim=16, heads=3)
    with pytest.raises(ValueError, match=r"`dropout` must be in \[0, 1\), got 1.0"):
        TransformerLanguageModel(20, dropout=1.0)
    with pytest.raises(ValueError, match="T <= 4"):
        TransformerLanguageModel(20, dim=8, heads=2, context=4)(torch.zeros(5, 1, dtype=torch.long))


def test_it_learns_a_repeating_sequence() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add contention
    try:
        _learn()
    finally:
        torch.set_num_threads(threads)


def _learn() -> None:
    model = new_model("transformer:dim=16,layers=1,heads=2,dropout=0", 10, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seq = torch.arange(10).repeat(3)[:21].reshape(21, 1)
    inp, tgt = seq[:-1], seq[1:]
    for _ in range(100):
        logits, _ = model(inp)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 10), tgt.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.1
