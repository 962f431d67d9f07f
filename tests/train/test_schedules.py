"""Tests for gradzip.train.schedules."""

from __future__ import annotations

import pytest
import torch

from gradzip.train.schedules import batch_scaled_lr, lr_at, set_lr

KW = {"base_lr": 0.1, "warmup_epochs": 5, "milestones": [30, 60], "gamma": 0.1, "workers": 8}


def test_warmup_edges() -> None:
    assert lr_at(0.0, **KW) == pytest.approx(0.1)
    assert lr_at(2.5, **KW) == pytest.approx(0.1 + 0.5 * 0.7)
    assert lr_at(5.0, **KW) == pytest.approx(0.8)
    assert lr_at(4.999999, **KW) == pytest.approx(0.8, rel=1e-5)
    assert lr_at(10.0, **KW) == pytest.approx(0.8)


def test_milestones_at_and_after() -> None:
    assert lr_at(29.999, **KW) == pytest.approx(0.8)
    assert lr_at(30.0, **KW) == pytest.approx(0.08)
    assert lr_at(45.0, **KW) == pytest.approx(0.08)
    assert lr_at(60.0, **KW) == pytest.approx(0.008)
    assert lr_at(1000.0, **KW) == pytest.approx(0.008)


def test_no_scaling_and_no_warmup() -> None:
    kw = dict(KW, scale_with_workers=False)
    assert lr_at(0.0, **kw) == pytest.approx(0.1)
    assert lr_at(2.5, **kw) == pytest.approx(0.1)
    assert lr_at(30.0, **kw) == pytest.approx(0.01)
    kw = dict(KW, warmup_epochs=0)
    assert lr_at(0.0, **kw) == pytest.approx(0.8)
    assert lr_at(0.0, base_lr=0.2, warmup_epochs=0, milestones=[]) == pytest.approx(0.2)
    assert lr_at(0.0, base_lr=0.2, warmup_epochs=0, milestones=[0], gamma=0.5) == 0.1


def test_milestone_during_warmup_and_repeated() -> None:
    kw = dict(KW, milestones=[2, 2])
    assert lr_at(1.0, **kw) == pytest.approx(0.1 + 0.2 * 0.7)
    assert lr_at(2.5, **kw) == pytest.approx((0.1 + 0.5 * 0.7) * 0.01)


@pytest.mark.parametrize(
    ("override", "exc", "message"),
    [
        ({"epoch_float": -1.0}, ValueError, "`epoch_float` must be >= 0, got -1.0"),
        ({"epoch_float": float("nan")}, ValueError, "`epoch_float` must be"),
        ({"base_lr": 0.0}, ValueError, "`base_lr` must be > 0, got 0.0"),
        ({"base_lr": "0.1"}, TypeError, "`base_lr` must be a real number"),
        ({"warmup_epochs": -1}, ValueError, "`warmup_epochs` must be"),
        ({"milestones": [60, 30]}, ValueError, "`milestones` must be non-decreasing"),
        ({"milestones": 30}, TypeError, "`milestones` must be a sequence"),
        ({"milestones": [-1]}, ValueError, "`milestones` must be >= 0"),
        ({"gamma": 0}, ValueError, "`gamma` must be > 0, got 0"),
        ({"workers": 0}, ValueError, "`workers` must be >= 1, got 0"),
        ({"workers": 2.0}, TypeError, "`workers` must be an integer"),
        ({"scale_with_workers": 1}, TypeError, "`scale_with_workers` must be a bool"),
    ],
)
def test_lr_at_validation(override: dict, exc: type, message: str) -> None:
    kw = dict(KW, epoch_float=1.0)
    kw.update(override)
    epoch = kw.pop("epoch_float")
    with pytest.raises(exc, match=message):
        lr_at(epoch, **kw)


def test_set_lr() -> None:
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    opt = torch.optim.SGD([{"params": params[:1]}, {"params": params[1:], "lr": 1.0}], lr=0.5)
    set_lr(opt, 0.25)
    assert [g["lr"] for g in opt.param_groups] == [0.25, 0.25]
    with pytest.raises(TypeError, match="`optimizer` must be a torch.optim.Optimizer"):
        set_lr(object(), 0.1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`lr` must be >= 0, got -1"):
        set_lr(opt, -1)


def test_batch_scaled_lr() -> None:
    assert batch_scaled_lr(0.1, 1024, 256) == pytest.approx(0.4)
    assert batch_scaled_lr(0.1, 128, 256) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="`reference_batch` must be >= 1, got 0"):
        batch_scaled_lr(0.1, 128, 0)
    with pytest.raises(ValueError, match="`base_lr` must be > 0"):
        batch_scaled_lr(-0.1, 128, 256)
