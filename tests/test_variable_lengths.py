"""Micro-batches of different sequence lengths within a step, padded each to its own
longest, under every synchronous schedule and PipeDream: the same losses and weights as
the unpipelined GPT on the same micro-batches (the token mean exact)."""

from __future__ import annotations

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


@pytest.mark.slow
def test_every_synchronous_schedule_on_two_ranks() -> None:
    per_rank = pipetrain.launch(cases.synchronous_runs, 2, cases.SYNCHRONOUS, None, timeout_s=240)
    assert_like_the_unpipelined(merged(per_rank))


@pytest.mark.slow
def test_schedules_on_three_ranks() -> None:
    per_rank = pipetrain.launch(cases.synchronous_runs, 3, THREE_RANKS, None, timeout_s=240)
    assert_like_the_unpipelined(merged(per_rank))


@pytest.mark.parametrize("balance", [[3, 3], [2, 2, 2]])
def test_pipedream_applies_its_rule_to_micro_batches_of_every_length(balance: list[int]) -> None:
    states = pipetrain.launch(cases.pipedream_run, len(balance), balance, timeout_s=300)
    got = {k: v for state in states for k, v in state.items()}
    expected = cases.pipedream_reference(balance)
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-6, msg=name)


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
@pytest.mark.parametrize("budget", [None, cases.LLAMA_BUDGET])
def test_a_captured_llama_takes_rows_of_every_length_without_capturing_again(
    budget: int | None,
) -> None:
    schedules = ["gpipe", "1f1b", "zb-h1"]
    per_rank = pipetrain.launch(cases.llama_runs, 2, schedules, budget, timeout_s=240)
    assert_like_the_unpipelined(merged(per_rank), cases.llama_reference(budget))


@pytest.mark.slow
def test_packed_rows_under_every_family_on_two_ranks() -> None:
    schedules = ["gpipe", "1f1b", "zb-h1", "interleaved", "zb-v"]
    per_rank = pipetrain.launch(cases.packed_runs, 2, schedules, timeout_s=240)
    assert_like_the_unpipelined(merged(per_rank), cases.packed_reference())
