"""A user's corpus from files: documents read as a stream, tokenized (bytes or a local
Hugging Face tokenizer), cut or refused at a maximum length, split into training and
held-out documents, and formed into padded micro-batches; the reading position is plain
data, so a resumed run goes on with the same batches."""

from pipetrain.data.corpus import Batches, Corpus, Summary
from pipetrain.data.documents import DataError, Document, DocumentReader, Position
from pipetrain.data.tokenizer import ByteTokenizer, HuggingFaceTokenizer, load_tokenizer

__all__ = [
    "Batches",
    "ByteTokenizer",
    "Corpus",
    "DataError",
    "Document",
    "DocumentReader",
    "HuggingFaceTokenizer",
    "Position",
    "Summary",
    "load_tokenizer",
]
