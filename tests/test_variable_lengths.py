"""Documents of 8 to 1,024 tokens, padded per micro-batch, by a token budget or packed
several to a row, under every synchronous schedule and PipeDream, on the built-in GPT and
a captured Hugging Face Llama: the same losses and weights as the unpipelined model on the
same micro-batches (the token mean exact); packed rows compute what their documents do one
by one."""

from __future__ import annotations

import random

import llama_length_cases as llama
import pytest
import torch
import variable_length_cases as cases

import pipetrain
from pipetrain.runtime import MicroBatches

THREE_RANKS = ["gpipe", "1f1b", "zb-h1", "interleaved", "zb-v"]


def merged(per_rank: list[list[dict]]) -> dict[str, dict]:
    """Each schedule's losses (rank 0's, which every rank shares) and whole state."""
    runs: dict[str, dict] = {}
    for results in per_rank:
        for result in results:
            run = runs.setdefault(result["schedule"], {"losses": result["losses"], "state": {}})
            assert run["losses"] == result["losses"]
            run["state"].update(result["state"])
    return runs


def assert_like_the_unpipelined(runs: dict[str, dict], expected: dict | None = None) -> None:
    expected = expected or cases.synchronous_reference()
    for schedule, run in runs.items():
        torch.testing.assert_close(
            run["losses"], expected["losses"], rtol=1e-5, atol=0, msg=schedule
        )
        assert sorted(run["state"]) == sorted(expected["state"])
        for name, value in expected["state"].items():
            torch.testing.assert_close(
                run["state"][name], value, rtol=1e-4, atol=1e-6, msg=f"{schedule} {name}"
            )


def test_the_micro_batches_of_a_step_differ_in_length() -> None:
    for batch in cases.step_batches():
        lengths = {x.shape[1] for x, _ in batch}
        assert len(lengths) >= 3
    lengths = {len(r) for rows in llama.llama_steps() for r in rows}
    lengths |= {x.shape[1] for batch in cases.step_batches() for x, _ in batch}
    assert min(lengths) == 8 and max(lengths) == 1024, sorted(lengths)


def owners(per_rank: list[list[dict]]) -> dict[str, int]:
    """The rank (PipeDream's stage) whose run returned each weight."""
    return {name: rank for rank, results in enumerate(per_rank) for name in results[0]["state"]}


def assert_weights_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_every_synchronous_schedule_on_two_ranks() -> None:
    per_rank = pipetrain.launch(cases.synchronous_runs, 2, cases.SYNCHRONOUS, None, timeout_s=240)
    assert_like_the_unpipelined(merged(per_rank))


@pytest.mark.slow
def test_schedules_on_three_ranks() -> None:
    per_rank = pipetrain.launch(cases.synchronous_runs, 3, THREE_RANKS, None, timeout_s=240)
    assert_like_the_unpipelined(merged(per_rank))


@pytest.mark.parametrize("balance", [[3, 3], pytest.param([2, 2, 2], marks=pytest.mark.slow)])
def test_pipedream_applies_its_rule_to_micro_batches_of_every_length(balance: list[int]) -> None:
    states = pipetrain.launch(cases.pipedream_run, len(balance), balance, timeout_s=300)
    got = {k: v for state in states for k, v in state.items()}
    assert_weights_equal(got, cases.pipedream_reference(balance))


def test_micro_batches_of_another_count_are_refused() -> None:
    from pipetrain.runtime.rank.batch import StepData

    data = StepData(3, 3, torch.device("cpu"))
    with pytest.raises(ValueError, match="come as 2 micro-batches but the step plays 3"):
        data.set_inputs(MicroBatches([torch.zeros(1, 4), torch.zeros(1, 5)]))


def test_a_token_budget_changes_the_micro_batch_count_from_step_to_step() -> None:
    counts = [len(cases.budget_groups(rows, 1)) for rows in cases.budget_rows()]
    assert len(set(counts)) == len(counts), counts
    for rows in cases.budget_rows():
        for group in cases.budget_groups(rows, 1):
            longest = max(len(rows[i]) for i in group)
            assert len(group) * longest <= cases.BUDGET or len(group) == 1


@pytest.mark.slow
def test_token_budget_micro_batches_equal_the_unpipelined_model() -> None:
    per_rank = pipetrain.launch(cases.budget_runs, 2, ["gpipe", "1f1b", "zb-h1"], timeout_s=240)
    assert_like_the_unpipelined(merged(per_rank), cases.budget_reference(1))
    per_rank = pipetrain.launch(cases.budget_runs, 2, ["interleaved"], timeout_s=240)
    assert_like_the_unpipelined(merged(per_rank), cases.budget_reference(2))


def test_a_token_budget_refuses_what_cannot_change_its_count() -> None:
    from pipetrain.runtime import PipelineConfig

    with pytest.raises(ValueError, match="an asynchronous schedule cannot follow"):
        PipelineConfig("pipedream", 2, microbatch_tokens=64).build(2, 4)
    with pytest.raises(ValueError, match="microbatch_tokens must be a positive"):
        PipelineConfig("gpipe", 2, microbatch_tokens=0).build(2, 4)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("budget", "schedules"),
    [(None, ["gpipe", "1f1b", "zb-h1", "interleaved", "zb-v"]), (llama.BUDGET, ["1f1b", "zb-h1"])],
)
def test_a_captured_llama_takes_rows_of_every_length_without_capturing_again(
    budget: int | None, schedules: list[str]
) -> None:
    per_rank = pipetrain.launch(llama.llama_runs, 2, schedules, budget, timeout_s=300)
    assert_like_the_unpipelined(merged(per_rank), llama.llama_reference(budget))


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True])
def test_a_captured_llama_under_pipedream(packed: bool) -> None:
    run = llama.packed_runs if packed else llama.llama_runs
    arguments = (["pipedream"], "llama-untied") if packed else (["pipedream"], None, "llama-untied")
    per_rank = pipetrain.launch(run, 2, *arguments, timeout_s=300)
    got = {k: v for results in per_rank for k, v in results[0]["state"].items()}
    parameters = {n for n, _ in llama.llama("llama-untied").named_parameters()}
    expected = llama.pipedream_reference(
        {n: r for n, r in owners(per_rank).items() if n in parameters}, packed
    )
    assert_weights_equal({n: v for n, v in got.items() if n in parameters}, expected)


@pytest.mark.slow
def test_packed_rows_under_every_family_on_two_ranks() -> None:
    schedules = ["gpipe", "1f1b", "zb-h1", "interleaved", "zb-v"]
    per_rank = pipetrain.launch(cases.packed_runs, 2, schedules, timeout_s=300)
    assert_like_the_unpipelined(merged(per_rank), cases.packed_reference())


@pytest.mark.slow
def test_packed_rows_on_three_ranks_and_under_pipedream() -> None:
    per_rank = pipetrain.launch(cases.packed_runs, 3, ["1f1b", "zb-v"], timeout_s=300)
    assert_like_the_unpipelined(merged(per_rank), cases.packed_reference())
    per_rank = pipetrain.launch(cases.packed_runs, 2, ["pipedream"], [3, 3], timeout_s=300)
    got = {k: v for results in per_rank for k, v in results[0]["state"].items()}
    assert_weights_equal(got, cases.packed_pipedream_reference([3, 3]))


@pytest.mark.slow
def test_packed_rows_of_a_captured_llama_under_every_family() -> None:
    schedules = ["gpipe", "1f1b", "zb-h1", "interleaved", "zb-v"]
    per_rank = pipetrain.launch(llama.packed_runs, 2, schedules, timeout_s=300)
    assert_like_the_unpipelined(merged(per_rank), llama.packed_reference())
    per_rank = pipetrain.launch(llama.packed_runs, 3, ["gpipe", "zb-h1"], timeout_s=300)
    assert_like_the_unpipelined(merged(per_rank), llama.packed_reference())


def test_packed_llama_rows_compute_what_their_documents_do_one_by_one() -> None:
    """Captured with ``position_ids``, the Llama's segments on packed rows give each
    document the logits and loss it has alone: no attention across documents."""
    from pipetrain.data.batches import pack_groups, packed_positions

    model = llama.llama()
    graph = llama.captured(model, positions=True)
    documents = cases.documents(6, random.Random(7), vocab=64)
    inputs, labels = packed_positions(documents, 1024, rows=2)
    out = graph.inputs(inputs)
    for _, layer in graph.layers:
        out = layer(*out)
    logits = graph.outputs(out).logits
    total, count = pipetrain.causal_lm_loss(logits, labels)
    alone_total, alone_count = 0.0, 0
    with torch.no_grad():
        for row, group in enumerate(pack_groups([len(d) for d in documents], 1024, rows=2)):
            start = 0
            for index in group:
                ids = torch.tensor([documents[index]])
                alone = model(ids).logits
                stop = start + ids.shape[1]
                torch.testing.assert_close(logits[row, start:stop], alone[0], rtol=1e-4, atol=1e-5)
                alone_loss, alone_tokens = pipetrain.causal_lm_loss(alone, ids)
                alone_total += alone_loss.item()
                alone_count += int(alone_tokens)
                start = stop
    assert int(count) == alone_count
    assert total.item() == pytest.approx(alone_total, rel=1e-5)


@pytest.mark.slow  # 4 processes
def test_sharded_replicas_take_micro_batches_of_every_length() -> None:
    import shard_cases

    schedules = ["gpipe", "1f1b", "zb-h1", "zb-v"]
    per_rank = pipetrain.launch(
        shard_cases.lengths_on_sharded_replicas, 4, schedules, timeout_s=300
    )
    assert_like_the_unpipelined(merged(per_rank))
