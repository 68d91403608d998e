"""A captured model's modes, guards and evaluation: captured in training mode whatever
mode it is in, trained and evaluated as the unpipelined model in either mode (dropout,
batch normalization, SDPA's attention dropout and ``self.training`` branches), conditions
on input shapes kept, a model's own loss evaluated, split points of a captured model."""

from __future__ import annotations

import copy

import graph_mode_cases as cases
import pytest
import torch

import pipetrain
from pipetrain.model.frontend import front_end
from pipetrain.model.graph import GraphModel


def test_a_model_in_eval_mode_trains_and_evaluates_as_the_unpipelined_one_in_each_mode() -> None:
    per_rank = pipetrain.launch(cases.train_modes, 2, timeout_s=300)
    expected = cases.mode_reference()
    state: dict[str, torch.Tensor] = {}
    for result in per_rank:
        assert result["modes"] == cases.MODES
        assert result["losses"] == pytest.approx(expected["losses"], rel=1e-5)
        assert result["still"] is True
        torch.testing.assert_close(result["evaluated"], expected["evaluated"])
        state.update(result["state"])
    assert sorted(state) == sorted(expected["state"])
    for name, value in expected["state"].items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("name", [pytest.param("gpt2", marks=pytest.mark.slow), "bert"])
def test_eval_step_is_the_models_eval_mode_with_and_without_labels(name: str) -> None:
    pytest.importorskip("transformers")
    per_rank = pipetrain.launch(cases.evaluate_hf, 2, name, timeout_s=180)
    model = cases.hf_dropout_model(name)
    state = {k: v for result in per_rank for k, v in result["state"].items()}
    model.load_state_dict(state, strict=False)
    model.eval()
    batch = cases.tokens(1)
    with torch.no_grad():
        expected = model(**batch)
        logits_only = model(input_ids=batch["input_ids"]).logits
    for result in per_rank:
        for loss, logits in (result["first"], result["second"]):
            torch.testing.assert_close(loss, expected.loss, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(logits, expected.logits, rtol=1e-5, atol=1e-6)
        loss, logits = result["logits_only"]
        assert loss is None
        torch.testing.assert_close(logits, logits_only, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("evaluate", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_inputs_breaking_a_guard_of_the_capture_are_refused_naming_it(evaluate: bool) -> None:
    within = pipetrain.launch(cases.guarded, 2, 8, evaluate, timeout_s=300)
    assert within == ["", ""]
    beyond = pipetrain.launch(cases.guarded, 2, 16, evaluate, timeout_s=300)
    for message in beyond:
        assert "break a condition the model was captured under" in message, message
        assert "x.size()[1] <= 8" in message, message


def test_a_first_stage_checks_the_guards_in_either_mode() -> None:
    model = cases.LengthBranch()
    graph = GraphModel(model, torch.randn(2, 8, 4))
    whole = graph.stage(0, len(graph.names))
    x = torch.randn(3, 8, 4)
    torch.testing.assert_close(whole(x)[0], model(x))
    for training in (True, False):
        whole.train(training)
        with pytest.raises(ValueError, match=r"x.size\(\)\[1\] <= 8"):
            whole(torch.randn(3, 16, 4))


def test_split_points_recut_a_captured_model_without_capturing_again() -> None:
    graph = GraphModel(cases.mode_net(), cases.data(0)[0][:2])
    assert graph.names == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "end"]
    recut = front_end(graph, None, ["blocks.3"])
    assert isinstance(recut, GraphModel) and recut.captured is graph.captured
    assert recut.names == ["start", "blocks.3"] and recut.split
    assert front_end(graph, None, None) is graph
    per_rank = pipetrain.launch(cases.split_graph, 2, timeout_s=300)
    assert "blocks.2.linear.weight" in per_rank[0]
    assert not any(name.startswith("blocks.3") for name in per_rank[0])
    assert "blocks.3.linear.weight" in per_rank[1] and "head.weight" in per_rank[1]


def test_a_model_in_eval_mode_is_captured_in_training_mode_and_left_as_it_was() -> None:
    model = cases.mode_net().eval()
    x = cases.data(0)[0]
    graph = GraphModel(model, x[:2])
    assert not any(module.training for module in model.modules())
    whole = graph.stage(0, len(graph.names))
    training = copy.deepcopy(model).train()
    torch.testing.assert_close(whole(x)[0], training(x))  # batch statistics, the 0.5 branch
    for name, buffer in training.named_buffers():  # running statistics updated alike
        torch.testing.assert_close(whole.get_buffer(name), buffer, msg=name)
    whole.eval()
    torch.testing.assert_close(whole(x)[0], training.eval()(x))


@pytest.mark.parametrize("name", [pytest.param("gpt2", marks=pytest.mark.slow), "bert"])
def test_eval_step_turns_sdpa_attention_dropout_off(name: str) -> None:
    pytest.importorskip("transformers")
    per_rank = pipetrain.launch(cases.evaluate_logits, 2, name, timeout_s=180)
    model = cases.hf_dropout_model(name).eval()
    with torch.no_grad():
        expected = model(input_ids=cases.tokens(1)["input_ids"]).logits
    for first, second in per_rank:
        torch.testing.assert_close(first, expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(second, expected, rtol=1e-5, atol=1e-6)


def test_a_sample_sliced_from_a_batch_guards_nothing_of_the_batch() -> None:
    """Export guards a view's base; the capture's sample is copied first, so inputs that
    are no slices run (as a profiler's do)."""
    pytest.importorskip("transformers")
    model = cases.hf_dropout_model("gpt2").eval()
    stream = torch.randint(1, 32, (4, 9), generator=torch.Generator().manual_seed(0))
    graph = GraphModel(model, stream[:2, :-1])  # a view, as a language model's inputs are
    whole = graph.stage(0, len(graph.names)).eval()
    fresh = stream[:, :-1].clone()
    with torch.no_grad():
        got = graph.outputs(whole(fresh), evaluation=True)
        torch.testing.assert_close(got.logits, model(fresh).logits)
