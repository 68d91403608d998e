"""Turning a document's text into token ids: bytes by default, or a local Hugging Face
tokenizer directory (loaded with ``transformers``, which is imported only then).

Nothing is downloaded and no code from the directory runs: the tokenizer is loaded with
``local_files_only=True`` and ``trust_remote_code=False``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from pipetrain.data.documents import DataError

BYTE_VOCABULARY = 256


class Tokenizer(Protocol):
    """What the corpus needs of a tokenizer."""

    name: str
    vocab_size: int

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """The token ids of each text."""


class ByteTokenizer:
    """A text's UTF-8 bytes as its token ids (0..255), as the built-in GPT reads them."""

    name = "bytes"
    vocab_size = BYTE_VOCABULARY

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """The UTF-8 bytes of each text."""
        return [list(text.encode("utf-8")) for text in texts]


class HuggingFaceTokenizer:
    """A tokenizer saved with ``save_pretrained`` in a local directory."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        """Load the tokenizer in ``directory``. DataError, naming the directory and what
        went wrong, for a path that is not one or does not load."""
        path = Path(directory)
        if not path.is_dir():
            raise DataError(
                f"tokenizer {str(path)!r} is not a directory; give a directory saved with "
                "a Hugging Face tokenizer's save_pretrained (tokenizer.json and its config)"
            )
        try:
            from transformers import AutoTokenizer  # deferred: slow to import

            loaded: Any = AutoTokenizer.from_pretrained(
                str(path), local_files_only=True, trust_remote_code=False
            )
        except Exception as error:  # transformers raises many kinds for a bad directory
            raise DataError(
                f"tokenizer {str(path)!r} does not load ({type(error).__name__}: "
                f"{str(error)[:300]}); give a directory saved with save_pretrained"
            ) from error
        self._tokenizer = loaded
        self.name = str(path)
        self.vocab_size = len(loaded)

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """The token ids of each text, without special tokens added."""
        if not texts:
            return []
        encoded = self._tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        return [list(ids) for ids in encoded]


def load_tokenizer(directory: str | os.PathLike[str] | None) -> Tokenizer:
    """The tokenizer in ``directory``, or bytes when it is ``None``."""
    return ByteTokenizer() if directory is None else HuggingFaceTokenizer(directory)
