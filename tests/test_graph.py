"""The graph front-end: stock Hugging Face models, captured and cut with no change to the
model, train as the unpipelined model does, with tied weights kept one parameter."""

from __future__ import annotations

from typing import Any

import graph_cases as cases
import pytest
import torch

import pipetrain

pytest.importorskip("transformers")

SCHEDULES = [
    {"schedule": "gpipe"},
    {"schedule": "1f1b", "recompute": "except_last"},
    {"schedule": "zb-h1"},
    {"schedule": "interleaved", "schedule_options": {"virtual": 2}},
]


def assert_trains_as_unpipelined(name: str, per_rank: list[list[dict[str, Any]]]) -> None:
    expected = cases.reference(name)
    aliases = _aliases(name)
    for index, config in enumerate(SCHEDULES):
        results = [rank[index] for rank in per_rank]
        state: dict[str, torch.Tensor] = {}
        for result in results:
            assert result["losses"] == pytest.approx(expected["losses"], rel=1e-4), config
            for key, value in result["state"].items():
                if key in state:  # a shared parameter: every copy bit-identical
                    assert torch.equal(state[key], value), (config, key)
                state[key] = value
        assert set(state) <= set(expected["state"]), set(state) - set(expected["state"])
        for names in aliases:  # every parameter of the model is held under one of its names
            assert any(n in state for n in names), names
        for key, value in state.items():
            torch.testing.assert_close(
                value, expected["state"][key], rtol=1e-4, atol=1e-5, msg=f"{config} {key}"
            )


def _aliases(name: str) -> list[set[str]]:
    """Each parameter's names in the model (two for a tied one)."""
    model = cases.hf_model(name)
    names: dict[int, set[str]] = {}
    for key, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), set()).add(key)
    return list(names.values())


@pytest.mark.parametrize("world", [2, 3])
def test_gpt2_tied_trains_as_unpipelined(world: int) -> None:
    per_rank = pipetrain.launch(cases.train, world, "gpt2", SCHEDULES, timeout_s=240)
    assert per_rank[0][0]["shared"], "GPT-2's embedding and head are tied across stages"
    assert_trains_as_unpipelined("gpt2", per_rank)
