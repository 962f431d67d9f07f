"""Tests for gradzip.train.models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradzip.train import models as M
from gradzip.train.data import iter_batches, load_digits, shard_indices


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_resnet18_width64_parameter_count() -> None:
    assert _count(M.ResNetCifar(18, width=64, num_classes=10)) == 11_173_962
    assert _count(M.build_model("resnet18", 10)) == 11_173_962


@pytest.mark.parametrize("depth", [8, 14, 20, 18])
def test_resnet_forward_shape(depth: int) -> None:
    model = M.ResNetCifar(depth, width=4, num_classes=7)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)


def test_resnet_block_counts_and_in_channels() -> None:
    model = M.ResNetCifar(20, width=8, in_channels=1)
    assert [len(stage) for stage in model.stages] == [3, 3, 3]
    assert model(torch.randn(2, 1, 16, 16)).shape == (2, 10)
    assert [len(s) for s in M.ResNetCifar(18, width=4).stages] == [2, 2, 2, 2]


def test_resnet_validation() -> None:
    with pytest.raises(ValueError, match="`depth` must be one of 8, 14, 20, 18, got 7"):
        M.ResNetCifar(7)
    with pytest.raises(TypeError, match="`width` must be an integer"):
        M.ResNetCifar(20, width=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`num_classes` must be >= 1, got 0"):
        M.ResNetCifar(20, num_classes=0)


@pytest.mark.parametrize("cfg", ["vgg-tiny", "vgg11", "vgg16", "vgg19"])
def test_vgg_forward_shape(cfg: str) -> None:
    model = M.VGGCifar(cfg, width_multiplier=0.125, num_classes=5)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 5)


def test_vgg_options() -> None:
    plain = M.VGGCifar("vgg11", batch_norm=False)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in plain.modules())
    convs = [m for m in M.VGGCifar("vgg11", width_multiplier=0.5).modules()
             if isinstance(m, nn.Conv2d)]
    assert len(convs) == 8 and convs[0].out_channels == 32 and convs[-1].out_channels == 256
    with pytest.raises(ValueError, match="`cfg` must be one of vgg-tiny, vgg11, vgg16, vgg19"):
        M.VGGCifar("vgg13")
    with pytest.raises(ValueError, match="`width_multiplier` must be > 0, got 0"):
        M.VGGCifar("vgg11", width_multiplier=0)


@pytest.mark.slow
def test_digitsnet_learns_digits() -> None:
    torch.manual_seed(0)
    task = load_digits(seed=0)
    model = M.DigitsNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for epoch in range(6):
        model.train()
        for x, y in iter_batches(task.train, shard_indices(len(task.train), 1, 0, epoch, 0), 32):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(task.test.x).argmax(1) == task.test.y).float().mean().item()
    assert accuracy > 0.9


def test_lstm_forward_backward_shapes() -> None:
    model = M.LSTMLanguageModel(50, embed=16, hidden=16, layers=2, tie_weights=True)
    assert model.decoder.weight is model.encoder.weight
    hidden = model.init_hidden(3)
    assert hidden[0].shape == (2, 3, 16) and hidden[1].shape == (2, 3, 16)
    tokens = torch.randint(0, 50, (7, 3))
    logits, hidden = model(tokens, hidden)
    assert logits.shape == (7, 3, 50)
    loss = nn.functional.cross_entropy(logits.view(-1, 50), tokens.view(-1))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    hidden = model.detach_hidden(hidden)
    assert not hidden[0].requires_grad
    logits, _ = model(tokens)
    assert logits.shape == (7, 3, 50)


def test_lstm_validation() -> None:
    with pytest.raises(ValueError, match="`embed` must equal hidden=32"):
        M.LSTMLanguageModel(10, embed=16, hidden=32, tie_weights=True)
    with pytest.raises(ValueError, match="`dropout` must be a number in"):
        M.LSTMLanguageModel(10, dropout=1.0)
    model = M.LSTMLanguageModel(10, embed=4, hidden=4, layers=1)
    with pytest.raises(ValueError, match="`input` must be a 2-D tensor"):
        model(torch.zeros(3, dtype=torch.long))


def test_logistic_regression() -> None:
    model = M.LogisticRegression(12, num_classes=3)
    assert model(torch.randn(5, 3, 4)).shape == (5, 3)
    assert _count(model) == 12 * 3 + 3
    with pytest.raises(ValueError, match="`num_classes` must be >= 2, got 1"):
        M.LogisticRegression(4, num_classes=1)


def test_build_model_registry() -> None:
    names = M.available_models()
    for name in ("resnet8", "resnet20", "resnet18", "vgg11", "vgg-tiny",
                 "digitsnet", "logreg", "lstm"):
        assert name in names
    assert isinstance(M.build_model("ResNet8", 10), M.ResNetCifar)
    assert M.build_model("resnet8", 10).stem[0].out_channels == 16
    assert isinstance(M.build_model("digitsnet", 10), M.DigitsNet)
    assert M.build_model("logreg", 2, num_features=7).linear.in_features == 7
    lstm = M.build_model("lstm", 30, embed=8, hidden=8)
    assert isinstance(lstm, M.LSTMLanguageModel) and lstm.vocab_size == 30
    assert M.build_model("vgg-tiny", 4, width_multiplier=0.25).classifier.out_features == 4
    with pytest.raises(ValueError, match="`name` must be one of .*resnet18.*got 'resnet50'"):
        M.build_model("resnet50", 10)
    with pytest.raises(TypeError, match="`name` must be a str"):
        M.build_model(18, 10)  # type: ignore[arg-type]
