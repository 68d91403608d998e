"""A corpus on disk as a stream of documents, read from any saved position.

A corpus is one of:

- a JSONL file (``.jsonl``): one JSON object a line, each a document given as ``text`` (a
  string) or ``input_ids`` (a list of token ids); blank lines are skipped;
- a text file (any other name): documents separated by blank lines;
- a directory: every file under it (sorted by path, hidden ones skipped), each ``.jsonl``
  file read as JSONL and any other file as one document.

Reading is line by line, so memory does not grow with the corpus. A :class:`Position` (the
file, the byte offset in it and the documents read so far) is plain data: reading from it
again yields exactly the documents that followed it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

JSONL_SUFFIX = ".jsonl"
FIELDS = ("text", "input_ids")


class DataError(ValueError):
    """A corpus that cannot be trained on; the message names the file (and line) and the fix."""


@dataclass(frozen=True)
class Position:
    """Where reading goes on: file ``file`` of the corpus at byte ``offset``, after
    ``document`` documents (of the whole corpus, held-out ones included) were read."""

    file: int = 0
    offset: int = 0
    document: int = 0


@dataclass(frozen=True)
class Document:
    """One document: its ``text`` or its token ids (``input_ids``), where it was read
    (``where``: the file, and the line for JSONL) and its number in the corpus."""

    number: int
    where: str
    text: str | None = None
    input_ids: tuple[int, ...] | None = None


def corpus_files(path: str | os.PathLike[str]) -> list[Path]:
    """The files of the corpus at ``path`` in reading order. DataError for a path that
    does not exist or a directory without files."""
    root = Path(path)
    if not root.exists():
        raise DataError(f"corpus {str(root)!r} does not exist; give a file or a directory")
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise DataError(f"corpus {str(root)!r} is neither a file nor a directory")
    files = sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )
    if not files:
        raise DataError(f"corpus directory {str(root)!r} holds no files; add documents to it")
    return files


class DocumentReader:
    """Reads the documents of the corpus at ``path`` (see the module's docstring)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        """Find the corpus's files (DataError if there are none)."""
        self.path = Path(path)
        self.files = corpus_files(path)
        self._whole_files = self.path.is_dir()

    def documents(self, start: Position | None = None) -> Iterator[tuple[Document, Position]]:
        """Each document from ``start`` (the corpus's start by default) to its end, with
        the position after it."""
        start = start or Position()
        if not 0 <= start.file <= len(self.files):
            raise DataError(
                f"data position names file {start.file} of a corpus of {len(self.files)} "
                f"files ({self.path}); resume with the corpus the position was saved with"
            )
        number = start.document
        for index in range(start.file, len(self.files)):
            offset = start.offset if index == start.file else 0
            for document, after in self._read_file(index, offset, number):
                number = document.number + 1
                yield document, Position(index, after, number)

    def _read_file(self, index: int, offset: int, number: int) -> Iterator[tuple[Document, int]]:
        path = self.files[index]
        try:
            with open(path, "rb") as stream:
                stream.seek(offset)
                if path.suffix == JSONL_SUFFIX:
                    yield from _jsonl(stream, path, number)
                elif self._whole_files:
                    yield from _whole(stream, path, number)
                else:
                    yield from _paragraphs(stream, path, number)
        except OSError as error:
            raise DataError(f"cannot read corpus file {str(path)!r}: {error.strerror}") from error


def _decoded(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise DataError(
            f"{where}: not UTF-8 text (byte {error.start}); convert the file to UTF-8"
        ) from error


def _whole(stream: BinaryIO, path: Path, number: int) -> Iterator[tuple[Document, int]]:
    """A file that is one document (a directory's member); an empty one is skipped."""
    if stream.tell() > 0:
        return
    text = _decoded(stream.read(), str(path))
    if text.strip():
        yield Document(number, str(path), text=text), stream.tell()


def _paragraphs(stream: BinaryIO, path: Path, number: int) -> Iterator[tuple[Document, int]]:
    """Documents separated by blank lines, each ended at the offset after it."""
    lines: list[bytes] = []
    first = 0
    line_number = _lines_before(path, stream.tell())
    while True:
        line = stream.readline()
        line_number += 1
        if line.strip():
            if not lines:
                first = line_number
            lines.append(line)
            continue
        if lines:
            where = f"{path} line {first}"
            text = _decoded(b"".join(lines), where).rstrip("\r\n")
            yield Document(number, where, text=text), stream.tell()
            number, lines = number + 1, []
        if not line:
            return


def _jsonl(stream: BinaryIO, path: Path, number: int) -> Iterator[tuple[Document, int]]:
    """One document a non-blank line."""
    line_number = _lines_before(path, stream.tell())
    for raw in iter(stream.readline, b""):
        line_number += 1
        if not raw.strip():
            continue
        where = f"{path} line {line_number}"
        yield _record(_decoded(raw, where), where, number), stream.tell()
        number += 1


def _lines_before(path: Path, offset: int) -> int:
    """Lines before ``offset``, so that errors after a resume name the file's own line."""
    if offset == 0:
        return 0
    with open(path, "rb") as stream:
        return sum(chunk.count(b"\n") for chunk in _chunks(stream, offset))


def _chunks(stream: BinaryIO, limit: int) -> Iterator[bytes]:
    left = limit
    while left > 0:
        chunk = stream.read(min(left, 1 << 20))
        if not chunk:
            return
        left -= len(chunk)
        yield chunk


def _record(line: str, where: str, number: int) -> Document:
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as error:
        raise DataError(f"{where}: not a JSON object ({error}); fix or remove the line") from error
    if not isinstance(record, dict):
        raise DataError(f"{where}: a JSON {type(record).__name__}, not an object with 'text'")
    if isinstance(record.get("text"), str):
        return Document(number, where, text=record["text"])
    ids = record.get("input_ids")
    if isinstance(ids, list) and all(type(i) is int and i >= 0 for i in ids):
        return Document(number, where, input_ids=tuple(ids))
    if "text" in record or "input_ids" in record:
        raise DataError(
            f"{where}: 'text' must be a string and 'input_ids' a list of non-negative "
            "integers; fix the line"
        )
    keys = ", ".join(sorted(record)[:8]) or "none"
    raise DataError(f"{where}: no 'text' or 'input_ids' field (its keys: {keys}); add one")
