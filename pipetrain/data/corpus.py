"""A user's corpus as token sequences: training batches from a saved position, a held-out
split, and a scan that finds bad data before training starts.

Documents are read in the corpus's order (:mod:`~pipetrain.data.documents`) and tokenized
in chunks, so memory stays constant however large the corpus. Every document numbered
``n`` with ``int((n + 1) * eval_fraction) > int(n * eval_fraction)`` is held out (evenly
spread, the same on every reading); the others are trained on, epoch after epoch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from itertools import islice
from typing import Any

from pipetrain.checks import positive_int
from pipetrain.data.documents import DataError, Document, DocumentReader, Position
from pipetrain.data.tokenizer import Tokenizer, load_tokenizer

LONG_DOCUMENTS = ("truncate", "refuse")
ENCODE_CHUNK = 256  # documents tokenized at once

Tokens = list[int]


@dataclass(frozen=True)
class Summary:
    """What a scan of the whole corpus found."""

    documents: int
    training: int
    held_out: int
    tokens: int
    longest: int
    truncated: int


class Corpus:
    """The corpus at ``path``, tokenized by ``tokenizer`` (a local Hugging Face tokenizer
    directory, a :class:`~pipetrain.data.tokenizer.Tokenizer`, or bytes when ``None``).

    A document longer than ``seq_len_max`` tokens is cut to its first ``seq_len_max``
    (``long_documents="truncate"``) or refused with a DataError naming it (``"refuse"``).
    Construction finds the files and loads the tokenizer (DataError for a missing corpus or
    a tokenizer that does not load); :meth:`scan` reads everything once.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        tokenizer: str | os.PathLike[str] | Tokenizer | None = None,
        *,
        seq_len_max: int = 1024,
        long_documents: str = "truncate",
        eval_fraction: float = 0.05,
    ) -> None:
        """Open the corpus; see the class docstring."""
        self.seq_len_max = positive_int("seq_len_max", seq_len_max)
        if long_documents not in LONG_DOCUMENTS:
            raise ValueError(
                f"long_documents must be one of {', '.join(LONG_DOCUMENTS)}, got {long_documents!r}"
            )
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction!r}")
        self.long_documents, self.eval_fraction = long_documents, eval_fraction
        self.reader = DocumentReader(path)
        if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = load_tokenizer(tokenizer)
        self.tokenizer = tokenizer

    def is_held_out(self, number: int) -> bool:
        """Whether document ``number`` belongs to the held-out split."""
        fraction = self.eval_fraction
        return int((number + 1) * fraction) > int(number * fraction)

    def tokenized(
        self, start: Position | None = None
    ) -> Iterator[tuple[Document, Tokens, Position]]:
        """Every non-empty document from ``start`` (the corpus's start by default) with its
        tokens (cut or refused at ``seq_len_max``) and the position after it."""
        documents = self.reader.documents(start or Position())
        while chunk := list(islice(documents, ENCODE_CHUNK)):
            texts = [d.text for d, _ in chunk if d.text is not None]
            encoded = iter(self.tokenizer.encode(texts))
            for document, after in chunk:
                given = document.input_ids
                ids = next(encoded) if given is None else list(given)
                if ids:
                    yield document, self._fitted(document, ids), after

    def _fitted(self, document: Document, ids: Tokens) -> Tokens:
        vocabulary = self.tokenizer.vocab_size
        if document.text is None and max(ids) >= vocabulary:
            raise DataError(
                f"{document.where}: token id {max(ids)} is outside the tokenizer's "
                f"vocabulary of {vocabulary} ({self.tokenizer.name}); give the tokenizer "
                "the ids were made with"
            )
        if len(ids) <= self.seq_len_max:
            return ids
        if self.long_documents == "refuse":
            raise DataError(
                f"{document.where}: a document of {len(ids)} tokens is longer than "
                f"seq_len_max {self.seq_len_max}; raise the maximum, shorten the document, "
                "or truncate long documents"
            )
        return ids[: self.seq_len_max]

    def scan(self) -> Summary:
        """Read and tokenize the whole corpus once. DataError for any bad document (named
        with its file and line), an empty corpus, or one with no training documents."""
        documents = training = tokens = longest = truncated = 0
        for document, ids, _ in self.tokenized():
            documents += 1
            training += not self.is_held_out(document.number)
            tokens += len(ids)
            longest = max(longest, len(ids))
            truncated += self._was_cut(document, ids)
        where = self.reader.path
        if documents == 0:
            raise DataError(f"corpus {str(where)!r} holds no documents; it is empty")
        if training == 0:
            raise DataError(
                f"corpus {str(where)!r}: all {documents} documents are held out; "
                "lower eval_fraction or add documents"
            )
        return Summary(documents, training, documents - training, tokens, longest, truncated)

    def _was_cut(self, document: Document, ids: Tokens) -> bool:
        # only a document at the maximum can have been cut: tokenize it again to tell
        if len(ids) < self.seq_len_max:
            return False
        if document.text is None:
            return len(document.input_ids or ()) > self.seq_len_max
        return len(self.tokenizer.encode([document.text])[0]) > self.seq_len_max

    def held_out(self, limit: int) -> list[Tokens]:
        """The first ``limit`` held-out documents' tokens (fewer if the split is smaller)."""
        positive_int("limit", limit)
        found: list[Tokens] = []
        if self.eval_fraction == 0:
            return found
        for document, ids, _ in self.tokenized():
            if self.is_held_out(document.number):
                found.append(ids)
                if len(found) == limit:
                    break
        return found

    def batches(self, batch_size: int) -> Batches:
        """Training batches of ``batch_size`` documents, from the corpus's start."""
        return Batches(self, batch_size)


class Batches:
    """An endless iterator of training batches, each ``batch_size`` documents' tokens in
    the corpus's order (an epoch ends where the corpus does; the next starts over). Its
    position (:meth:`state_dict`, plain data) restored into a stream of the same corpus
    (:meth:`load_state_dict`) goes on with exactly the batches that followed it."""

    def __init__(self, corpus: Corpus, batch_size: int) -> None:
        """Batches of ``corpus`` from its start."""
        self.corpus, self.batch_size = corpus, positive_int("batch_size", batch_size)
        self.epoch, self.position = 0, Position()
        self._reading: Iterator[tuple[Document, Tokens, Position]] | None = None
        self._from_start, self._found = False, 0  # of the epoch being read

    def __iter__(self) -> Batches:
        """The stream is its own iterator."""
        return self

    def __next__(self) -> list[Tokens]:
        """The next batch's documents."""
        batch: list[Tokens] = []
        while len(batch) < self.batch_size:
            batch.extend(self._next_epoch_part(self.batch_size - len(batch)))
        return batch

    def _next_epoch_part(self, wanted: int) -> list[Tokens]:
        if self._reading is None:
            self._from_start, self._found = self.position == Position(), 0
            self._reading = self.corpus.tokenized(self.position)
        found: list[Tokens] = []
        for document, ids, after in self._reading:
            self.position = after
            if not self.corpus.is_held_out(document.number):
                found.append(ids)
                self._found += 1
                if len(found) == wanted:
                    return found
        if self._from_start and self._found == 0:
            raise DataError(f"corpus {str(self.corpus.reader.path)!r} has no training documents")
        self.epoch, self.position, self._reading = self.epoch + 1, Position(), None
        return found

    def state_dict(self) -> dict[str, Any]:
        """The position after the last batch returned: epoch, file, offset, document."""
        return {"epoch": self.epoch, "batch_size": self.batch_size, **asdict(self.position)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from a position :meth:`state_dict` returned (of the same corpus and batch
        size). DataError for one of another batch size."""
        if int(state["batch_size"]) != self.batch_size:
            raise DataError(
                f"the data position was saved with batches of {state['batch_size']} "
                f"documents, not {self.batch_size}; resume with the same batch size"
            )
        self.epoch = int(state["epoch"])
        self.position = Position(int(state["file"]), int(state["offset"]), int(state["document"]))
        self._reading = None
