"""``pipetrain train --data``: a user's corpus as the built-in GPT's training steps.

Each step takes ``batch_size`` documents in the corpus's order; a document's tokens but its
last are the inputs and its tokens but its first the targets (a one-token document has a
target of ``IGNORE_INDEX``, which no loss counts). A step is given as
:class:`~pipetrain.runtime.Sequences`, so the pipeline forms the micro-batches: a fixed
count padded each to its own longest, or by a token budget (``--microbatch-tokens``); or,
with ``pack``, as rows of several documents each (:func:`pipetrain.data.batches.packed`),
``((tokens, documents), targets)``, split into the fixed count of micro-batches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from pipetrain.app.step_costs import StepPricer, shapes_of
from pipetrain.data import Corpus, Summary
from pipetrain.data.batches import IGNORE_INDEX, fixed_groups, packed, token_budget_groups
from pipetrain.profiler.lengths import Shape
from pipetrain.runtime import Sequences

EVAL_DOCUMENTS = 64  # the held-out batch's documents, at most


@dataclass(frozen=True)
class CorpusSettings:
    """Where the corpus is and how it is read: ``path`` (a text file, a directory of
    documents, or JSONL), ``tokenizer`` (a local Hugging Face tokenizer directory, ``None``
    for bytes), ``seq_len_max`` tokens a document at most, longer ones cut
    (``long_documents="truncate"``) or refused (``"refuse"``), and the held-out
    ``eval_fraction`` of the documents; with ``pack``, each step's documents are packed
    into rows of at most ``seq_len_max`` tokens."""

    path: str
    tokenizer: str | None = None
    seq_len_max: int = 256
    long_documents: str = "truncate"
    eval_fraction: float = 0.05
    pack: bool = False

    def open(self) -> Corpus:
        """The corpus (DataError for a missing path or a tokenizer that does not load)."""
        return Corpus(
            self.path,
            self.tokenizer,
            seq_len_max=self.seq_len_max,
            long_documents=self.long_documents,
            eval_fraction=self.eval_fraction,
        )

    def vocabulary(self) -> int:
        """The tokenizer's vocabulary size: the GPT's embedding and output width."""
        return self.open().tokenizer.vocab_size


def scanned(settings: CorpusSettings) -> Summary:
    """The whole corpus read once, before any worker starts: DataError names a bad
    document by file and line, or an empty corpus."""
    return settings.open().scan()


def next_token_pair(ids: list[int]) -> tuple[Tensor, Tensor]:
    """A document's inputs (its tokens but the last) and targets (but the first)."""
    tokens = torch.as_tensor(ids, dtype=torch.int64)
    if len(tokens) == 1:
        return tokens, torch.tensor([IGNORE_INDEX])
    return tokens[:-1], tokens[1:]


Step = tuple[Sequences, Sequences] | tuple[tuple[Tensor, Tensor], Tensor]


class CorpusStream:
    """An endless iterator of ``(inputs, targets)`` steps of ``batch_size`` documents, each
    a :class:`~pipetrain.runtime.Sequences` grouped into ``count`` micro-batches, or within
    ``budget`` tokens, or as the ``pricer`` finds fastest (``--adaptive``); or packed into
    rows split into ``count`` micro-batches. ``shapes`` keeps each step's micro-batch
    shapes and ``choices`` the adaptive choice of each step; :meth:`state_dict` is the
    reading position (plain data, saved with a checkpoint) and :meth:`eval_set` a fixed
    held-out batch."""

    def __init__(
        self,
        settings: CorpusSettings,
        batch_size: int,
        count: int = 1,
        *,
        budget: int | None = None,
        pricer: StepPricer | None = None,
    ) -> None:
        """Read ``settings``'s corpus from its start."""
        self.settings, self.count, self.budget, self.pricer = settings, count, budget, pricer
        self.corpus = settings.open()
        self.batches = self.corpus.batches(batch_size)
        self.shapes: list[list[Shape]] = []
        self.choices: list[dict[str, Any]] = []

    def __iter__(self) -> CorpusStream:
        """The stream is its own iterator."""
        return self

    def __next__(self) -> Step:
        """The next step's documents as input and target rows, or packed."""
        pairs = [next_token_pair(ids) for ids in next(self.batches)]
        if self.settings.pack:
            (tokens, documents), targets = packed(pairs, self.settings.seq_len_max, self.count)
            rows, width = tokens.shape
            self.shapes.append([(len(g), width) for g in fixed_groups(rows, self.count)])
            return (tokens, documents), targets
        lengths = [len(x) for x, _ in pairs]
        if self.pricer is not None:
            name, groups, predicted_s, plain_s = self.pricer.choose(
                lengths, self.count, self.budget
            )
            self.choices.append(
                {
                    "formation": name,
                    "predicted_s": predicted_s,
                    "predicted_gain": plain_s / predicted_s,
                }
            )
        elif self.budget is not None:
            groups = token_budget_groups(lengths, self.budget)
        else:
            groups = fixed_groups(len(lengths), self.count)
        self.shapes.append(shapes_of(lengths, groups))
        return Sequences([x for x, _ in pairs], groups), Sequences([y for _, y in pairs], groups)

    def tokens(self, targets: Tensor | Sequence[Tensor]) -> int:
        """The tokens a step's targets count (its padding and one-token documents not)."""
        rows = [targets] if isinstance(targets, Tensor) else targets
        return sum(int((row != IGNORE_INDEX).sum()) for row in rows)

    def state_dict(self) -> dict[str, Any]:
        """The position after the last step returned."""
        return self.batches.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from a saved position of the same corpus; a run resumed with another
        batch size (``--new-settings``) goes on from the same document."""
        self.batches.load_state_dict({**state, "batch_size": self.batches.batch_size})

    def eval_set(self) -> tuple[Tensor, Tensor]:
        """The first held-out documents (up to :data:`EVAL_DOCUMENTS`), padded to the
        longest: inputs with 0, targets with ``IGNORE_INDEX``."""
        documents = self.corpus.held_out(EVAL_DOCUMENTS)
        if not documents:
            raise ValueError(
                f"corpus {self.corpus.reader.path} has no held-out documents to evaluate on; "
                "give a larger --eval-fraction or leave out --eval-every"
            )
        pairs = [next_token_pair(ids) for ids in documents]
        inputs = pad_sequence([x for x, _ in pairs], batch_first=True, padding_value=0)
        targets = pad_sequence([y for _, y in pairs], batch_first=True, padding_value=IGNORE_INDEX)
        return inputs, targets
