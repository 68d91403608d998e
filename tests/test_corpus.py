"""User corpora from files: reading, tokenizing, held-out split, bad data named before
training, and a saved position that resumes with exactly the same batches."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from pipetrain.data import Corpus, DataError, DocumentReader

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran"]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def word_tokenizer(directory: Path) -> Path:
    """A tiny word-level Hugging Face tokenizer saved with save_pretrained."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocabulary = {"[UNK]": 0, "[PAD]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    core = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]")
    fast.save_pretrained(str(directory))
    return directory


def brute_documents(records: list[dict]) -> list[str]:
    return [r["text"] for r in records]


def test_jsonl_text_is_tokenized_as_bytes_with_a_held_out_split(tmp_path: Path) -> None:
    records = [{"text": f"doc {n} " + "x" * n} for n in range(40)]
    corpus = Corpus(write_jsonl(tmp_path / "c.jsonl", records), eval_fraction=0.1)
    summary = corpus.scan()
    texts = brute_documents(records)
    held = [n for n in range(40) if n % 10 == 9]
    assert (summary.documents, summary.held_out, summary.training) == (40, 4, 36)
    assert summary.tokens == sum(len(t.encode()) for t in texts)
    assert corpus.held_out(10) == [list(texts[n].encode()) for n in held]
    stream = corpus.batches(6)
    seen = [ids for _ in range(6) for ids in next(stream)]
    assert seen == [list(texts[n].encode()) for n in range(40) if n not in held]
    # the next epoch starts over
    assert next(stream)[0] == list(texts[0].encode())


def test_input_ids_text_files_and_directories(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [5, 6, 7]}, {"input_ids": [1]}])
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.txt").write_text("second")
    (tmp_path / "docs" / "a.txt").write_text("first\n\nstill first")
    (tmp_path / "docs" / ".hidden").write_text("never")
    write_jsonl(tmp_path / "docs" / "c.jsonl", [{"text": "third"}, {"input_ids": [9]}])
    (tmp_path / "para.txt").write_text("one\nline\n\n\ntwo\n\nthree\n")
    ids = Corpus(tmp_path / "ids.jsonl", eval_fraction=0)
    assert next(ids.batches(2)) == [[5, 6, 7], [1]]
    docs = Corpus(tmp_path / "docs", eval_fraction=0)
    expected = [b"first\n\nstill first", b"second", b"third", bytes([9])]
    assert next(docs.batches(4)) == [list(t) for t in expected]
    paragraphs = Corpus(tmp_path / "para.txt", eval_fraction=0)
    assert next(paragraphs.batches(3)) == [list(b"one\nline"), list(b"two"), list(b"three")]


def test_a_local_hugging_face_tokenizer(tmp_path: Path) -> None:
    directory = word_tokenizer(tmp_path / "tok")
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "the cat sat"}, {"text": "a dog ran on"}])
    corpus = Corpus(path, directory, eval_fraction=0)
    assert corpus.tokenizer.vocab_size == len(WORDS) + 2
    assert next(corpus.batches(2)) == [[2, 3, 4], [7, 8, 9, 5]]


def test_long_documents_are_truncated_or_refused_by_name(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", [{"text": "short"}, {"text": "y" * 50}])
    cut = Corpus(path, seq_len_max=8, eval_fraction=0)
    assert cut.scan().truncated == 1
    assert next(cut.batches(2)) == [list(b"short"), list(b"y" * 8)]
    refused = Corpus(path, seq_len_max=8, long_documents="refuse", eval_fraction=0)
    with pytest.raises(DataError, match=r"c.jsonl line 2: a document of 50 tokens .* 8"):
        refused.scan()


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (
            [{"text": "ok"}, {"body": "x"}],
            r"line 2: no 'text' or 'input_ids' field \(its keys: bo",
        ),
        ([{"text": 3}], r"line 1: 'text' must be a string"),
        ([{"input_ids": [1, 300]}], r"line 1: token id 300 is outside .* vocabulary of 256"),
    ],
)
def test_bad_jsonl_lines_are_named(tmp_path: Path, lines: list[dict], message: str) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", lines)
    with pytest.raises(DataError, match=message):
        Corpus(path, eval_fraction=0).scan()


def test_bad_corpora_and_tokenizers_are_named(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        Corpus(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="holds no documents"):
        Corpus(tmp_path / "empty.jsonl").scan()
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(DataError, match="line 2: not a JSON object"):
        Corpus(tmp_path / "bad.jsonl").scan()
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataError, match="holds no files"):
        Corpus(tmp_path / "empty_dir")
    (tmp_path / "notok").mkdir()
    (tmp_path / "notok" / "tokenizer.json").write_text("{ broken")
    with pytest.raises(DataError, match=r"notok.* does not load"):
        Corpus(tmp_path / "empty.jsonl", tmp_path / "notok")
    with pytest.raises(DataError, match="is not a directory"):
        Corpus(tmp_path / "empty.jsonl", tmp_path / "nowhere")


def test_a_saved_position_resumes_with_the_same_batches(tmp_path: Path) -> None:
    records = [{"text": f"document number {n} " + "z" * (n % 7)} for n in range(23)]
    path = write_jsonl(tmp_path / "c.jsonl", records)
    corpus = Corpus(path, eval_fraction=0.2)
    whole = corpus.batches(4)
    run = [next(whole) for _ in range(12)]  # past two epochs' ends
    for stop in (1, 4, 5, 9):
        first = corpus.batches(4)
        for _ in range(stop):
            next(first)
        state = json.loads(json.dumps(first.state_dict()))  # plain data
        resumed = Corpus(path, eval_fraction=0.2).batches(4)
        resumed.load_state_dict(state)
        assert [next(resumed) for _ in range(12 - stop)] == run[stop:]
    with pytest.raises(DataError, match="batches of 4 documents, not 3"):
        corpus.batches(3).load_state_dict(state)


def test_errors_after_a_resume_name_the_files_own_line(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b"}\n{"oops": 1}\n')
    reader = DocumentReader(path)
    _, after_first = next(reader.documents())
    with pytest.raises(DataError, match="line 4"):
        list(reader.documents(after_first))


def test_micro_batches_are_padded_each_to_its_own_longest() -> None:
    import torch

    from pipetrain.data.batches import IGNORE_INDEX, microbatches

    documents = [[5, 6, 7], [1], [2, 3], [4, 4, 4, 4, 4], [9, 8]]
    pieces = microbatches(documents, count=2)
    assert [p[0].shape for p in pieces] == [torch.Size([3, 3]), torch.Size([2, 5])]
    for (inputs, labels), group in zip(pieces, [documents[:3], documents[3:]], strict=True):
        for row, document in enumerate(group):
            assert labels[row, : len(document)].tolist() == document
            assert (labels[row, len(document) :] == IGNORE_INDEX).all()
            assert (inputs[row, len(document) :] == 0).all()


def test_token_budget_groups_partition_the_batch_within_the_budget() -> None:
    import random

    from pipetrain.data.batches import token_budget_groups

    chance = random.Random(0)
    for _ in range(200):
        lengths = [chance.randint(1, 64) for _ in range(chance.randint(1, 30))]
        budget = chance.randint(8, 256)
        groups = token_budget_groups(lengths, budget)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        for group in groups:
            cost = len(group) * max(lengths[i] for i in group)
            assert cost <= budget or len(group) == 1
        # greedy: no group could have taken the next group's first document
        for group, following in itertools.pairwise(groups):
            longest = max(lengths[i] for i in group)
            assert (len(group) + 1) * longest > budget
            assert lengths[following[0]] <= longest
