"""Digits, the standard-library corpus and batch streams: shapes, determinism, splits."""

from __future__ import annotations

import os
import sysconfig
from collections import Counter

import pytest
import torch
from sklearn.datasets import load_digits
from torch import Tensor

from pipetrain.app import data
from pipetrain.app.data import BatchStream, digits, stdlib_corpus
from pipetrain.app.models import MODEL_NAMES


def rows(tensor: Tensor) -> Counter:
    """The multiset of a tensor's rows (flattened)."""
    return Counter(tuple(row) for row in tensor.reshape(len(tensor), -1).tolist())


def test_digits_shapes_dtypes_and_range() -> None:
    (train_x, train_y), (test_x, test_y) = digits(flat=True)
    assert train_x.shape == (1437, 64) and test_x.shape == (360, 64)
    assert train_x.dtype == torch.float32 and train_y.dtype == torch.int64
    assert train_y.shape == (1437,) and test_y.shape == (360,)
    assert train_x.min() >= 0.0 and train_x.max() == 1.0
    (image_x, image_y), _ = digits(flat=False)
    assert image_x.shape == (1437, 1, 8, 8)
    assert torch.equal(image_x.reshape(-1, 64), train_x) and torch.equal(image_y, train_y)


def test_digits_split_is_a_partition_of_the_original_data() -> None:
    (train_x, train_y), (test_x, test_y) = digits(flat=True, seed=2)
    original = load_digits()
    original_x = torch.from_numpy((original.data / 16.0).astype("float32"))
    expected = Counter(zip(map(tuple, original_x.tolist()), original.target.tolist()))
    split_x, split_y = torch.cat([train_x, test_x]), torch.cat([train_y, test_y])
    assert Counter(zip(map(tuple, split_x.tolist()), split_y.tolist())) == expected


def test_digits_split_depends_only_on_seed() -> None:
    (first_x, _), _ = digits(flat=True, seed=0)
    (again_x, _), _ = digits(flat=True, seed=0)
    (other_x, _), _ = digits(flat=True, seed=1)
    assert torch.equal(first_x, again_x)
    assert not torch.equal(first_x, other_x)


def test_stdlib_corpus_starts_with_first_sorted_source_file() -> None:
    root = sysconfig.get_paths()["stdlib"]
    first = sorted(name for name in os.listdir(root) if name.endswith(".py"))[0]
    with open(os.path.join(root, first), "rb") as source:
        expected = source.read(1000)
    corpus = stdlib_corpus(1000)
    assert corpus.dtype == torch.uint8 and len(corpus) == 1000
    assert bytes(corpus.tolist()) == expected


def test_stdlib_corpus_is_deterministic_and_truncated() -> None:
    assert torch.equal(stdlib_corpus(50_000)[:30_000], stdlib_corpus(30_000))
    assert len(stdlib_corpus()) == 2_000_000


def test_stdlib_corpus_rejects_nonpositive_size() -> None:
    with pytest.raises(ValueError, match="max_bytes must be a positive integer, got 0"):
        stdlib_corpus(0)


def test_streams_exist_for_every_model() -> None:
    for name in MODEL_NAMES:
        inputs, targets = next(BatchStream(name, 4, seq_len=8))
        assert len(inputs) == len(targets) == 4


def test_gpt_targets_are_inputs_shifted_by_one() -> None:
    inputs, targets = next(BatchStream("gpt", 8, seq_len=32, seed=3))
    assert inputs.shape == targets.shape == (8, 32)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


@pytest.fixture
def marked_corpus(monkeypatch: pytest.MonkeyPatch) -> Tensor:
    """A 10 000-byte corpus: the training region (first 90%) counts 0..127, the tail 128..255."""
    train = torch.arange(9000) % 128
    tail = 128 + torch.arange(1000) % 128
    corpus = torch.cat([train, tail]).to(torch.uint8)
    monkeypatch.setattr(data, "stdlib_corpus", lambda: corpus)
    return corpus


def test_gpt_windows_are_contiguous_and_inside_training_region(marked_corpus: Tensor) -> None:
    stream = BatchStream("gpt", 64, seq_len=16, seed=0)
    for _ in range(20):
        inputs, targets = next(stream)
        windows = torch.cat([inputs, targets[:, -1:]], dim=1)
        assert (windows < 128).all()
        assert ((windows[:, 1:] - windows[:, :-1]) % 128 == 1).all()


def test_gpt_eval_windows_come_from_held_out_tail(marked_corpus: Tensor) -> None:
    inputs, targets = BatchStream("gpt", 4, seq_len=16).eval_set()
    assert inputs.shape == (1000 // 17, 16)
    assert (inputs >= 128).all() and (targets >= 128).all()
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert len(rows(inputs)) == len(inputs)


def test_gpt_eval_set_is_fixed() -> None:
    first = BatchStream("gpt", 4, seed=0).eval_set()
    other = BatchStream("gpt", 8, seed=5).eval_set()
    assert torch.equal(first[0], other[0]) and torch.equal(first[1], other[1])


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_stream_depends_only_on_seed(name: str) -> None:
    first, again, other = (BatchStream(name, 16, seq_len=16, seed=s) for s in (7, 7, 8))
    for _ in range(3):
        a, b, c = next(first), next(again), next(other)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_digit_epochs_cover_training_split_and_reshuffle() -> None:
    stream = BatchStream("mlp", 479)
    (train_x, _), test = digits(flat=True)
    assert stream.epoch_size == 3
    epochs = []
    for _ in range(2):
        epochs.append(torch.cat([next(stream)[0] for _ in range(stream.epoch_size)]))
        assert rows(epochs[-1]) == rows(train_x)
    assert not torch.equal(epochs[0], epochs[1])
    assert torch.equal(stream.eval_set()[0], test[0])


def test_cnn_stream_gives_images() -> None:
    stream = BatchStream("cnn", 10)
    inputs, targets = next(stream)
    assert inputs.shape == (10, 1, 8, 8) and targets.shape == (10,)
    assert stream.eval_set()[0].shape == (360, 1, 8, 8)


def test_digit_batches_drop_partial_batch() -> None:
    stream = BatchStream("mlp", 1000)
    assert stream.epoch_size == 1
    assert all(len(next(stream)[0]) == 1000 for _ in range(3))


def test_stream_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown model 'resnet'; choose one of mlp"):
        BatchStream("resnet", 4)
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        BatchStream("mlp", 0)
    with pytest.raises(ValueError, match="seq_len must be a positive integer, got 0"):
        BatchStream("gpt", 4, seq_len=0)
    with pytest.raises(ValueError, match="--batch-size 2000 exceeds the 1437"):
        BatchStream("mlp", 2000)
