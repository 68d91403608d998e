"""Stock Hugging Face models of many architectures, captured with no change: 2-rank 1f1b
training equal to the unpipelined model, ``eval_step`` equal to ``model.eval()``, a
checkpoint saved on one balance loading into another (and into every balance for T5,
BERT and GPT-2), and export read back by ``from_pretrained``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import zoo_cases as cases

import pipetrain
from pipetrain.model.graph import GraphModel

pytest.importorskip("transformers")


def _close(got: Any, expected: Any, what: str) -> None:
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=what)


@pytest.mark.slow
@pytest.mark.parametrize("name", cases.ZOO)
def test_a_stock_model_trains_evaluates_saves_and_exports_as_the_unpipelined_one(
    name: str, tmp_path: Path
) -> None:
    directory = tmp_path / "checkpoint"
    per_rank = pipetrain.launch(cases.zoo_run, 2, name, str(directory), timeout_s=300)
    expected = cases.reference(name)
    state: dict[str, torch.Tensor] = {}
    loaded: dict[str, torch.Tensor] = {}
    for result in per_rank:
        assert result["losses"] == pytest.approx(expected["losses"], rel=1e-4), name
        _close(result["eval_loss"], expected["eval_loss"], f"{name} eval loss")
        _close(result["eval_logits"], expected["eval_logits"], f"{name} eval logits")
        before, after = result["balances"]
        assert before != after
        assert result["after"][0] == pytest.approx(result["after"][1], rel=1e-5), name
        state.update(result["state"])
        loaded.update(result["loaded"])
    model_keys = set(per_rank[0]["model_keys"])
    assert set(state) <= model_keys, set(state) - model_keys  # no lifted constants
    for key, value in state.items():
        _close(value, expected["state"][key], f"{name} {key}")
        assert torch.equal(loaded[key], value), f"{name} {key} after loading"
    trip = cases.exported_round_trip(name, str(directory), str(tmp_path / "model.pt"))
    info = trip["info"]
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for key, value in trip["state"].items():
        assert torch.equal(value, trip["exported"][key]), f"{name} {key} from_pretrained"


@pytest.mark.parametrize(
    "name", [pytest.param("gpt2"), pytest.param("t5", marks=pytest.mark.slow), "bert"]
)
def test_a_checkpoint_loads_into_every_balance(name: str, tmp_path: Path) -> None:
    """Saved on [1, n-1], loaded into [2, n-2] ... [n-1, 1]: the same state, and the
    next step's loss is the saving pipeline's."""
    per_rank = pipetrain.launch(cases.move_checkpoint, 2, name, str(tmp_path), timeout_s=300)
    balances = per_rank[0]["balances"]
    assert len(balances) >= 3, balances
    saved = {k: v for result in per_rank for k, v in result["saved"].items()}
    for index in range(len(balances) - 1):
        loaded = {k: v for result in per_rank for k, v in result["loaded"][index].items()}
        assert loaded.keys() == saved.keys(), balances[index + 1]
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), (balances[index + 1], key)
    for result in per_rank:
        first, *others = result["losses"]
        assert others == pytest.approx([first] * len(others), rel=1e-5), balances


@pytest.mark.parametrize("name", ["t5", "gpt2"])
def test_lifted_constants_stay_out_of_the_state_dict(name: str) -> None:
    model = cases.build(name)
    graph = GraphModel(model, {k: v[:2] for k, v in cases.batch(name, 0).items()})
    keys = set(model.state_dict())
    for index in range(len(graph.names)):
        assert set(graph.stage(index, index + 1).state_dict()) <= keys, graph.names[index]


def test_eager_experts_are_refused_with_the_fix_that_captures() -> None:
    model = cases.build("mixtral")
    model.set_experts_implementation("eager")
    sample = {k: v[:2] for k, v in cases.batch("mixtral", 0).items()}
    with pytest.raises(RuntimeError, match=r'set_experts_implementation\("batched_mm"\)'):
        GraphModel(model, sample)
    model.set_experts_implementation("batched_mm")
    graph = GraphModel(model, sample)
    with torch.no_grad():
        expected = model(**cases.batch("mixtral", 1)).logits
        got = graph.outputs(
            graph.stage(0, len(graph.names))(*graph.inputs(cases.batch("mixtral", 1)))
        )
    torch.testing.assert_close(got.logits, expected)
