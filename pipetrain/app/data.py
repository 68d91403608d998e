"""Real training data that needs no download: scikit-learn's digits and Python's own source.

- :func:`digits`: the 1797 8x8 handwritten digits bundled with scikit-learn.
- :func:`stdlib_corpus`: the bytes of the standard library's ``.py`` files, for the byte GPT.
- :class:`BatchStream`: deterministic (inputs, targets) batches for a built-in model.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pipetrain.app.model_registry import model_spec
from pipetrain.checks import positive_int

Split = tuple[Tensor, Tensor]
"""Inputs and targets of one data split."""

TRAIN_FRACTION = 0.8  # of the digits; the rest is the test split
CORPUS_TRAIN_FRACTION = 0.9  # of the corpus bytes; gpt eval windows come from the rest
EVAL_WINDOWS = 128  # gpt eval-set size (windows of seq_len + 1 bytes)
_SKIPPED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)


@functools.lru_cache(maxsize=1)
def _digit_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The digits images (1797, 64) scaled to [0, 1] and their labels."""
    from sklearn.datasets import load_digits  # deferred: scikit-learn is slow to import

    bunch = load_digits()
    return (bunch.data / 16.0).astype(np.float32), bunch.target.astype(np.int64)


def digits(flat: bool, *, seed: int = 0) -> tuple[Split, Split]:
    """scikit-learn's digits as ``((train_x, train_y), (test_x, test_y))``, an 80/20 split.

    Pixels are float32 in [0, 1], shaped (N, 64) when ``flat`` else (N, 1, 8, 8); labels are
    int64. The split is a permutation drawn from ``seed``, so it is the same on every call.
    """
    images, labels = _digit_arrays()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    inputs = torch.from_numpy(images)[order]
    targets = torch.from_numpy(labels)[order]
    if not flat:
        inputs = inputs.reshape(-1, 1, 8, 8)
    cut = int(len(labels) * TRAIN_FRACTION)
    return (inputs[:cut], targets[:cut]), (inputs[cut:], targets[cut:])


def stdlib_corpus(max_bytes: int = 2_000_000) -> Tensor:
    """The standard library's ``.py`` sources concatenated: a uint8 tensor, at most ``max_bytes``.

    Files are read in sorted path order (so the corpus is deterministic for a given Python
    version); test directories, installed packages and unreadable files are skipped.
    """
    data = _read_stdlib(positive_int("max_bytes", max_bytes))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@functools.lru_cache(maxsize=4)
def _read_stdlib(max_bytes: int) -> bytes:
    """Read standard-library sources until ``max_bytes`` bytes are collected."""
    root = sysconfig.get_paths()["stdlib"]
    chunks: list[bytes] = []
    total = 0
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = sorted(d for d in subdirectories if d not in _SKIPPED_DIRS)
        for name in sorted(f for f in files if f.endswith(".py")):
            try:
                with open(os.path.join(directory, name), "rb") as source:
                    chunk = source.read(max_bytes - total)
            except OSError:
                continue
            chunks.append(chunk)
            total += len(chunk)
            if total >= max_bytes:
                return b"".join(chunks)
    return b"".join(chunks)


class BatchStream:
    """An endless iterator of ``(inputs, targets)`` training batches for a built-in model.

    - ``"gpt"``, ``"hf-gpt2"``, ``"hf-llama"``: random windows of ``seq_len + 1`` bytes from
      the first 90% of :func:`stdlib_corpus`; inputs are the first ``seq_len`` bytes and
      targets the same window shifted by one, both int64 (B, T).
    - ``"mlp"``, ``"uneven-mlp"``, ``"cnn"``, ``"vgg"``: the digits training split, reshuffled
      every epoch; a last partial batch is dropped so every batch has ``batch_size`` rows.

    The batches depend only on ``seed``.
    """

    def __init__(
        self, model_name: str, batch_size: int, *, seq_len: int = 64, seed: int = 0
    ) -> None:
        """Prepare the data for ``model_name``; see the class docstring."""
        self.model_name = model_name
        self._text = model_spec(model_name).text
        self.batch_size = positive_int("batch_size", batch_size)
        self.seq_len = positive_int("seq_len", seq_len)
        self._generator = torch.Generator().manual_seed(seed)
        if self._text:
            self._init_text()
        else:
            self._init_digits(flat=model_spec(model_name).data == "digits", seed=seed)

    def _init_text(self) -> None:
        """Split the corpus into a training region and a held-out tail."""
        self._corpus = stdlib_corpus()
        self._train_end = int(len(self._corpus) * CORPUS_TRAIN_FRACTION)
        if self._train_end <= self.seq_len + 1:
            raise ValueError(
                f"seq_len {self.seq_len} is too long for the corpus; use a shorter one"
            )
        self.epoch_size = max(1, self._train_end // (self.batch_size * self.seq_len))

    def _init_digits(self, flat: bool, seed: int) -> None:
        """Load the digits splits and draw the first epoch's order."""
        (self._train_x, self._train_y), self._test = digits(flat, seed=seed)
        self.epoch_size = len(self._train_y) // self.batch_size
        if self.epoch_size == 0:
            raise ValueError(
                f"--batch-size {self.batch_size} exceeds the {len(self._train_y)} digits "
                "training samples; give a smaller --batch-size"
            )
        self._order = torch.empty(0, dtype=torch.int64)
        self._position = 0

    def __iter__(self) -> BatchStream:
        """The stream is its own iterator."""
        return self

    def __next__(self) -> tuple[Tensor, Tensor]:
        """The next training batch."""
        if self._text:
            return self._next_text()
        return self._next_digits()

    def _next_text(self) -> tuple[Tensor, Tensor]:
        """Random windows from the training region of the corpus."""
        last_start = self._train_end - (self.seq_len + 1)
        starts = torch.randint(0, last_start + 1, (self.batch_size,), generator=self._generator)
        return self._windows(starts)

    def _windows(self, starts: Tensor) -> tuple[Tensor, Tensor]:
        """Windows of ``seq_len + 1`` bytes at ``starts``, split into inputs and shifted targets."""
        offsets = torch.arange(self.seq_len + 1)
        windows = self._corpus[starts[:, None] + offsets].long()
        return windows[:, :-1], windows[:, 1:]

    def _next_digits(self) -> tuple[Tensor, Tensor]:
        """The next slice of the current epoch's shuffled order."""
        if self._position + self.batch_size > len(self._order):
            self._order = torch.randperm(len(self._train_y), generator=self._generator)
            self._position = 0
        rows = self._order[self._position : self._position + self.batch_size]
        self._position += self.batch_size
        return self._train_x[rows], self._train_y[rows]

    def state_dict(self) -> dict[str, Any]:
        """The stream's position: its random generator's state and, for the digits, the
        epoch's order and the place in it; :meth:`load_state_dict` goes on from there."""
        state: dict[str, Any] = {"generator": self._generator.get_state()}
        if not self._text:
            state.update(order=self._order.clone(), position=self._position)
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from a position that :meth:`state_dict` returned (of a stream of the same
        model, batch size and seed)."""
        self._generator.set_state(state["generator"])
        if not self._text:
            self._order, self._position = state["order"].clone(), int(state["position"])

    def eval_set(self) -> tuple[Tensor, Tensor]:
        """A fixed held-out set: the digits test split, or for gpt evenly spaced windows from
        the last 10% of the corpus (which training windows never touch)."""
        if not self._text:
            return self._test
        window = self.seq_len + 1
        held_out = len(self._corpus) - self._train_end
        count = min(EVAL_WINDOWS, held_out // window)
        if count == 0:
            raise ValueError(
                f"seq_len {self.seq_len} is too long for the held-out corpus; use a shorter one"
            )
        stride = held_out // count
        starts = self._train_end + torch.arange(count) * stride
        return self._windows(starts)
