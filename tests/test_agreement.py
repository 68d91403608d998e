"""Ranks agree or stop: a pipeline built with different settings on different ranks stops
on every rank with the difference shown."""

from __future__ import annotations

import agreement_cases as cases
import pytest

import pipetrain
from pipetrain.runtime.agreement import differences


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, str]]:
    return pipetrain.launch(cases.disagreements, 2, timeout_s=300)


def test_every_rank_names_the_differing_setting_and_its_ranks(ranks: list[dict[str, str]]) -> None:
    for setting, expected in [
        ("balance", "balance: (2, 3) on rank 0; (3, 2) on rank 1"),
        ("microbatches", "microbatches: 2 on rank 0; 3 on rank 1"),
        ("mesh", "data_parallel: 2 on rank 0; 1 on rank 1"),
        ("mesh", "shard: True on rank 0; False on rank 1"),
        ("model", "the model differs between rank 0 and rank 1: '0.weight [12, 6] torch.float32'"),
    ]:
        messages = {rank[setting] for rank in ranks}
        assert len(messages) == 1, f"the ranks raised different errors for {setting}"
        message = messages.pop()
        assert message.startswith("the ranks were given different pipelines"), message
        assert expected in message


def test_agreeing_ranks_build_their_pipelines(ranks: list[dict[str, str]]) -> None:
    assert [rank["agreed"] for rank in ranks] == ["no error", "no error"]


def test_differences_group_the_ranks_of_each_value() -> None:
    gathered = [{"a": 1, "b": "x"}, {"a": 2, "b": "x"}, {"a": 2, "b": "x"}, {"a": 1}]
    assert differences(gathered) == [
        "a: 1 on ranks 0, 3; 2 on ranks 1, 2",
        "b: 'x' on ranks 0, 1, 2; None on rank 3",
    ]
    assert differences([{"model": ["p [1]"]}, {"model": ["p [1]", "q [2]"]}]) == [
        "the model differs between rank 0 and rank 1: 'q [2]' only on one side"
    ]
