"""``pipetrain train --data``: the built-in GPT on a corpus of one's own, documents of
every length, micro-batches by count or token budget, bad data named before any worker
starts, and a resume that goes on with the same batches."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from pipetrain.app import cli
from pipetrain.app.corpus_stream import CorpusSettings, CorpusStream, next_token_pair
from pipetrain.app.models import build_model
from pipetrain.app.models.gpt import gpt_token_loss
from pipetrain.data.batches import pack_groups, packed

LENGTHS = (8, 30, 120, 400, 1024)  # bytes: documents of very different lengths
STEPS, BATCH, SEQ_LEN_MAX = 4, 6, 1024


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """JSONL of 120 documents of 8 to 1024 bytes."""
    chance = random.Random(0)
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    words = [
        "pipeline",
        "stage",
        "micro",
        "batch",
        "gradient",
        "schedule",
        "rank",
        "token",
        "of",
        "the",
    ]
    with path.open("w") as out:
        for _ in range(120):
            text = " ".join(chance.choice(words) for _ in range(200))[: chance.choice(LENGTHS)]
            out.write(json.dumps({"text": text}) + "\n")
    return path


def refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """The error of ``pipetrain train ARGS``: exit status 2, and no worker started."""
    try:
        status = cli.main(["train", *args])
    except SystemExit as stop:  # argparse's refusals
        status = int(stop.code or 0)
    captured = capsys.readouterr()
    assert status == 2, captured.err
    assert "starting" not in captured.err, "no worker may start"
    return captured.err


def test_corpus_flags_without_data_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    error = refused(capsys, "--model", "gpt", "--microbatch-tokens", "64")
    assert "--microbatch-tokens reads a corpus of your own: give it with --data PATH" in error
    error = refused(capsys, "--model", "gpt", "--tokenizer", "somewhere")
    assert "--tokenizer reads a corpus" in error


def test_data_for_a_model_that_cannot_read_it_is_refused(
    capsys: pytest.CaptureFixture[str], corpus: Path
) -> None:
    assert "give --model gpt" in refused(capsys, "--model", "mlp", "--data", str(corpus))
    error = refused(capsys, "--model", "hf-llama", "--data", str(corpus))
    assert "captured at one sequence length" in error
    data = ("--model", "gpt", "--data", str(corpus), "--plan", "auto")
    error = refused(capsys, *data, "--microbatch-tokens", "500")
    assert "give --plan or the token budget, not both" in error


def test_bad_data_is_named_before_any_worker_starts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = tmp_path / "nowhere.jsonl"
    assert str(missing) in refused(capsys, "--model", "gpt", "--data", str(missing))
    fieldless = tmp_path / "bad.jsonl"
    fieldless.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    error = refused(capsys, "--model", "gpt", "--data", str(fieldless))
    assert f"{fieldless} line 2: no 'text' or 'input_ids' field" in error
    long = tmp_path / "long.txt"
    long.write_text("x" * 50)
    error = refused(
        capsys,
        "--model", "gpt", "--data", str(long), "--seq-len-max", "20",
        "--long-documents", "refuse",
    )  # fmt: skip
    assert "50 tokens is longer than seq_len_max 20" in error
    error = refused(capsys, "--model", "gpt", "--data", str(long), "--tokenizer", str(tmp_path))
    assert "does not load" in error


def layer_by_layer(model: torch.nn.Sequential, *inputs: torch.Tensor) -> torch.Tensor:
    """The model's layers in turn, a tuple of outputs unpacked as the pipeline does."""
    out: torch.Tensor | tuple[torch.Tensor, ...] = inputs
    for layer in model:
        out = layer(*out) if isinstance(out, tuple) else layer(out)
    assert isinstance(out, torch.Tensor)
    return out


def test_packed_rows_compute_what_their_documents_do_one_by_one() -> None:
    model = build_model("gpt", seed=0, context=128)
    chance = random.Random(1)
    documents = [
        [chance.randrange(256) for _ in range(chance.choice([1, 2, 5, 30, 60, 100]))]
        for _ in range(16)
    ]
    pairs = [next_token_pair(d) for d in documents]
    (tokens, numbers), targets = packed(pairs, 128, rows=3)
    assert tokens.shape[0] >= 3 and tokens.shape[1] <= 128
    total, count = gpt_token_loss(layer_by_layer(model, tokens, numbers), targets)
    alone = [gpt_token_loss(model(x[None]), y[None]) for x, y in pairs]
    torch.testing.assert_close(total, sum(t for t, _ in alone), rtol=1e-5, atol=0)
    assert count == sum(c for _, c in alone)


def test_packing_places_every_document_once_within_the_row_length() -> None:
    chance = random.Random(2)
    for _ in range(200):
        lengths = [chance.randint(1, 50) for _ in range(chance.randint(4, 30))]
        rows = chance.randint(1, 4)
        groups = pack_groups(lengths, 60, rows)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert len(groups) >= rows
        assert all(sum(lengths[i] for i in g) <= 60 for g in groups)
        # the same lengths always give the same rows
        assert groups == pack_groups(lengths, 60, rows)


def unpipelined_losses(corpus: Path) -> list[float]:
    """The same GPT, batches and Adam updates in one process, each step's loss the mean
    over every counted token of its batch padded whole."""
    model = build_model("gpt", seed=0, vocab=256, context=SEQ_LEN_MAX)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    stream = CorpusStream(CorpusSettings(str(corpus), seq_len_max=SEQ_LEN_MAX), BATCH)
    losses = []
    for _ in range(STEPS):
        inputs, targets = next(stream)
        pad = torch.nn.utils.rnn.pad_sequence
        total, count = gpt_token_loss(
            model(pad(list(inputs), batch_first=True)),
            pad(list(targets), batch_first=True, padding_value=-100),
        )
        loss = total / count
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def trained(capsys: pytest.CaptureFixture[str], corpus: Path, *flags: str) -> dict:
    """The JSON report of ``pipetrain train --model gpt --data CORPUS`` with ``flags``."""
    args = ["train", "--model", "gpt", "--data", str(corpus), "--batch-size", str(BATCH)]
    args += ["--seq-len-max", str(SEQ_LEN_MAX), "--json", *flags]
    assert cli.main(args) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_every_formation_equals_the_unpipelined_model_and_resumes_with_the_same_batches(
    capsys: pytest.CaptureFixture[str], corpus: Path, tmp_path: Path
) -> None:
    expected = unpipelined_losses(corpus)
    steps = ("--steps", str(STEPS))
    by_count = trained(capsys, corpus, *steps, "--microbatches", "3", "--schedule", "1f1b")
    by_budget = trained(
        capsys, corpus, *steps, "--microbatch-tokens", "1500", "--schedule", "gpipe"
    )
    by_packing = trained(capsys, corpus, *steps, "--pack", "--microbatches", "2")
    trace = tmp_path / "adaptive.json"
    adaptive = trained(
        capsys, corpus, *steps, "--adaptive", "--microbatch-tokens", "1500", "--trace", str(trace)
    )
    for report in (by_count, by_budget, by_packing, adaptive):
        torch.testing.assert_close(report["losses"], expected, rtol=1e-4, atol=0)
    assert by_budget["microbatch_tokens"] == 1500 and by_budget["tokens_per_s"] > 0
    # every step predicted from the profiled GPT, and the adaptive run's choice of each
    assert len(by_count["step_predicted_s"]) == STEPS and by_count["step_prediction_error"] >= 0
    assert by_count["step_prediction_error_calibrated"] >= 0
    assert len(adaptive["adaptive_choices"]) == STEPS
    assert all(c["predicted_gain"] >= 1 for c in adaptive["adaptive_choices"])
    # the last step's trace is titled with its choice
    last = adaptive["adaptive_choices"][-1]
    title = json.loads(trace.read_text())["traceEvents"][0]["args"]["name"]
    assert f"adaptive: {last['formation']}, predicted {last['predicted_gain']:.2f}x" in title
    # stopped after two steps, then resumed from its checkpoint to the fourth
    save = ("--save-dir", str(tmp_path / "run"), "--schedule", "zb-h1", "--microbatches", "2")
    trained(capsys, corpus, "--steps", "2", *save)
    resumed = trained(capsys, corpus, *steps, *save)
    torch.testing.assert_close(resumed["losses"], expected, rtol=1e-4, atol=0)


@pytest.mark.slow
def test_a_plan_made_on_the_corpus_lengths_trains_as_the_unpipelined_model(
    capsys: pytest.CaptureFixture[str], corpus: Path
) -> None:
    report = trained(capsys, corpus, "--steps", str(STEPS), "--plan", "auto")
    torch.testing.assert_close(report["losses"], unpipelined_losses(corpus), rtol=1e-4, atol=0)
    assert BATCH % report["microbatches"] == 0 and report["planned_step_s"] > 0
    packed_plan = trained(capsys, corpus, "--steps", "1", "--plan", "auto", "--pack")
    assert packed_plan["planned_step_s"] > 0


def test_the_adaptive_choice_is_the_fastest_candidate_simulated() -> None:
    from pipetrain.app.step_costs import StepPricer, candidates, shapes_of
    from pipetrain.profiler.lengths import LengthCosts

    fitted = LengthCosts(forward=[(1e-4, 1e-6, 1e-8)] * 6, backward=[(2e-4, 2e-6, 2e-8)] * 6)
    pricer = StepPricer(fitted, "1f1b", 2, [3, 3])
    chance = random.Random(4)
    for _ in range(20):
        lengths = [chance.choice([5, 40, 300, 1000]) for _ in range(12)]
        name, groups, best, plain = pricer.choose(lengths, 4, 1200)
        every = {
            n: pricer.step_s(shapes_of(lengths, g)) for n, g in candidates(lengths, 4, 1200).items()
        }
        assert best == min(every.values()) == every[name] and plain == every["consecutive"]
        assert sorted(i for g in groups for i in g) == list(range(12))


def test_groups_given_with_the_rows_take_every_row_once() -> None:
    from pipetrain.runtime import Sequences

    rows = [torch.ones(3), torch.ones(5), torch.ones(2)]
    assert Sequences(rows, [[2, 0], [1]]).groups == [[2, 0], [1]]
    for bad in ([[0, 1]], [[0, 1], [1, 2]], [[0, 1, 2], []]):
        with pytest.raises(ValueError, match="take each of the 3 rows once"):
            Sequences(rows, bad)
