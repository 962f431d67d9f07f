"""Tests for the training data layer: gradzip.train.data (digits, augmentation, sharding),
.text and .tabular. CIFAR-10 loading is tested in test_cifar.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gradzip.train import data as D
from gradzip.train import tabular as TB
from gradzip.train import text as T

# ---------------------------------------------------------------- digits


def test_load_digits_shapes_and_normalisation() -> None:
    task = D.load_digits(test_fraction=0.2, seed=0)
    assert task.num_classes == 10
    assert task.train.x.shape[1:] == (1, 8, 8)
    assert task.train.x.dtype == torch.float32
    assert task.train.y.dtype == torch.int64
    assert len(task.train) + len(task.test) == 1797
    assert len(task.test) == round(1797 * 0.2)
    assert abs(float(task.train.x.mean())) < 1e-4
    assert abs(float(task.train.x.std()) - 1.0) < 1e-3
    assert set(task.train.y.tolist()) == set(range(10))


def test_load_digits_split_is_seeded() -> None:
    a, b = D.load_digits(seed=1), D.load_digits(seed=1)
    c = D.load_digits(seed=2)
    assert torch.equal(a.test.x, b.test.x) and torch.equal(a.test.y, b.test.y)
    assert not torch.equal(a.test.y, c.test.y)


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1])
def test_load_digits_rejects_bad_fraction(bad: float) -> None:
    with pytest.raises(ValueError, match="`test_fraction` must be"):
        D.load_digits(test_fraction=bad)


def test_load_digits_rejects_bad_seed_type() -> None:
    with pytest.raises(TypeError, match="`seed` must be an integer, got '0'"):
        D.load_digits(seed="0")  # type: ignore[arg-type]


# ---------------------------------------------------------------- augmentation


def test_augment_batch_shape_and_determinism() -> None:
    x = torch.randn(16, 3, 32, 32)
    a = D.augment_batch(x, torch.Generator().manual_seed(5))
    b = D.augment_batch(x, torch.Generator().manual_seed(5))
    c = D.augment_batch(x, torch.Generator().manual_seed(6))
    assert a.shape == x.shape and a.dtype == x.dtype
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_augment_batch_is_crop_or_flip_of_padded_image() -> None:
    x = torch.arange(2 * 1 * 6 * 6, dtype=torch.float32).view(2, 1, 6, 6) + 1
    out = D.augment_batch(x, torch.Generator().manual_seed(0), pad=2)
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for i in range(2):
        windows = [padded[i, :, r:r + 6, c:c + 6] for r in range(5) for c in range(5)]
        windows += [w.flip(-1) for w in windows]
        assert any(torch.equal(out[i], w) for w in windows)


def test_augment_batch_identity_without_pad_or_flip() -> None:
    x = torch.randn(4, 3, 8, 8)
    out = D.augment_batch(x, torch.Generator().manual_seed(0), pad=0, flip=False)
    assert torch.equal(out, x)


def test_augment_batch_does_not_touch_global_rng() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    D.augment_batch(torch.randn(4, 3, 8, 8, generator=torch.Generator()),
                    torch.Generator().manual_seed(1))
    assert torch.equal(torch.rand(3), expected)


def test_augment_batch_validation() -> None:
    gen = torch.Generator()
    with pytest.raises(ValueError, match="`x` must be a 4-D tensor"):
        D.augment_batch(torch.zeros(3, 8, 8), gen)
    with pytest.raises(TypeError, match="`generator` must be a torch.Generator"):
        D.augment_batch(torch.zeros(1, 3, 8, 8), 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`pad` must be >= 0, got -1"):
        D.augment_batch(torch.zeros(1, 3, 8, 8), gen, pad=-1)


# ---------------------------------------------------------------- text


def test_load_text_word_level(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    lines = ["the cat sat"] * 9 + ["the dog ran"]
    path.write_text("\n".join(lines) + "\n")
    lm = T.load_text(path, level="word", valid_fraction=0.1)
    assert lm.vocab[0] == T.UNK
    assert set(lm.vocab) == {T.UNK, T.EOS, "the", "cat", "sat"}
    assert lm.train_ids.dtype == torch.int64
    assert len(lm.train_ids) == 9 * 4 and len(lm.valid_ids) == 4
    decoded = [lm.vocab[i] for i in lm.valid_ids.tolist()]
    assert decoded == ["the", T.UNK, T.UNK, T.EOS]


def test_load_text_char_level_and_directory(tmp_path: Path) -> None:
    (tmp_path / "ptb.train.txt").write_text("abcab\nba\n")
    (tmp_path / "ptb.valid.txt").write_text("abz\n")
    lm = T.load_text(tmp_path, level="char")
    assert set(lm.vocab) == {T.UNK, "a", "b", "c", "\n"}
    assert [lm.vocab[i] for i in lm.valid_ids.tolist()] == ["a", "b", T.UNK, "\n"]
    assert len(lm.train_ids) == 9


def test_load_text_validation(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_text("a b\nc d\n")
    with pytest.raises(ValueError, match="`level` must be one of 'word', 'char', got 'byte'"):
        T.load_text(path, level="byte")
    with pytest.raises(ValueError, match="`valid_fraction` must be"):
        T.load_text(path, valid_fraction=1.5)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="non-empty"):
        T.load_text(tmp_path / "empty.txt")


def test_batchify_and_bptt() -> None:
    ids = torch.arange(23)
    data = T.batchify(ids, 4)
    assert data.shape == (5, 4)
    assert data[:, 1].tolist() == [5, 6, 7, 8, 9]
    pairs = list(T.bptt_batches(data, 3))
    assert [p[0].shape[0] for p in pairs] == [3, 1]
    for inp, tgt in pairs:
        assert torch.equal(inp + 1, tgt)
    with pytest.raises(ValueError, match="`batch_size` must be"):
        T.batchify(torch.arange(3), 4)
    with pytest.raises(ValueError, match="`bptt` must be >= 1, got 0"):
        T.bptt_batches(data, 0)
    with pytest.raises(ValueError, match="`ids` must be a 1-D tensor"):
        T.batchify(data, 2)


# ---------------------------------------------------------------- libsvm / logreg


def test_load_libsvm(tmp_path: Path) -> None:
    path = tmp_path / "a.svm"
    rows = ["+1 1:0.5 3:2", "-1 2:1.5 # comment", "", "+1 qid:3 4:-1"] * 3
    path.write_text("\n".join(rows) + "\n")
    task = TB.load_libsvm(path, test_fraction=0.25, seed=0)
    assert task.num_classes == 2 and task.meta["labels"] == [-1.0, 1.0]
    assert task.train.x.shape == (7, 4) and task.test.x.shape == (2, 4)
    assert task.train.x.dtype == torch.float32
    full = TB.load_libsvm(path, num_features=6, test_path=path)
    assert full.train.x.shape == (9, 6)
    assert full.train.x[0].tolist() == [0.5, 0, 2, 0, 0, 0]
    assert full.train.y[:3].tolist() == [1, 0, 1]
    with pytest.raises(ValueError, match="`num_features` must be >= the largest index 4"):
        TB.load_libsvm(path, num_features=3)


def test_load_libsvm_label_mapping_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "b.svm"
    path.write_text("2 1:1\n1 1:2\n3 2:1\n2 1:0\n")
    task = TB.load_libsvm(path, test_path=path)
    assert task.num_classes == 3 and task.train.y.tolist() == [1, 0, 2, 1]
    bad = tmp_path / "bad.svm"
    bad.write_text("1 0:1\n")
    with pytest.raises(ValueError, match="LIBSVM format"):
        TB.load_libsvm(bad)


def test_make_logreg_problem() -> None:
    task = TB.make_logreg_problem(n=500, d=20, seed=3)
    again = TB.make_logreg_problem(n=500, d=20, seed=3)
    assert task.train.x.shape == (400, 20) and task.test.x.shape == (100, 20)
    assert torch.equal(task.train.x, again.train.x)
    agree = ((task.train.x @ task.meta["w"] > 0).long() == task.train.y).float().mean()
    assert 0.85 < float(agree) < 1.0
    assert 0.3 < float(task.train.y.float().mean()) < 0.7


# ---------------------------------------------------------------- sharding


def test_shards_disjoint_equal_and_cover() -> None:
    n, world = 103, 4
    shards = [D.shard_indices(n, world, r, epoch=0, seed=7) for r in range(world)]
    assert all(len(s) == n // world for s in shards)
    joined = torch.cat(shards)
    assert len(set(joined.tolist())) == len(joined) == 100
    assert set(joined.tolist()) <= set(range(n))
    full = D.shard_indices(n, 1, 0, epoch=0, seed=7)
    assert sorted(full.tolist()) == list(range(n))


def test_shards_deterministic_and_vary_by_epoch() -> None:
    a = D.shard_indices(50, 2, 1, epoch=3, seed=1)
    assert torch.equal(a, D.shard_indices(50, 2, 1, epoch=3, seed=1))
    assert not torch.equal(a, D.shard_indices(50, 2, 1, epoch=4, seed=1))
    assert not torch.equal(a, D.shard_indices(50, 2, 1, epoch=3, seed=2))


def test_shard_validation() -> None:
    with pytest.raises(ValueError, match="`rank` must be < world_size=2, got 2"):
        D.shard_indices(10, 2, 2, 0, 0)
    with pytest.raises(ValueError, match="`n` must be >= 4, got 3"):
        D.shard_indices(3, 4, 0, 0, 0)
    with pytest.raises(TypeError, match="`epoch` must be an integer"):
        D.shard_indices(10, 2, 0, 1.5, 0)  # type: ignore[arg-type]


def test_iter_batches() -> None:
    split = D.TensorSplit(torch.arange(10).float()[:, None], torch.arange(10))
    idx = D.shard_indices(10, 1, 0, 0, 0)
    batches = list(D.iter_batches(split, idx, 3))
    assert [len(y) for _, y in batches] == [3, 3, 3]
    assert torch.equal(torch.cat([y for _, y in batches]), idx[:9])
    assert len(list(D.iter_batches(split, idx, 3, drop_last=False))) == 4
