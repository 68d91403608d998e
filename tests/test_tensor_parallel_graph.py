"""Tensor-parallel stages of a captured Hugging Face Llama (tied embeddings, grouped-query
attention): 2 stages x 2 mirrors (4 gloo processes; with 2 replicas, 8), every step's loss
and every parameter against the unpipelined model, and the graph pass in one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import graph_cases as cases
import pytest
import torch
from test_graph import _aliases, assert_same_training

import pipetrain
from pipetrain.checkpoint import load_full
from pipetrain.model.graph import GraphModel
from pipetrain.runtime.rank.tensor_parallel import stage_plan
from pipetrain.runtime.rank.tensor_parallel_regions import COPY, REDUCE, GraphPass

pytest.importorskip("transformers")

PLAN = {  # transformers' base_model_tp_plan for Llama, under the causal LM's base model
    f"model.layers.{i}.{path}": style
    for i in range(4)
    for path, style in [
        ("self_attn.q_proj", "colwise"), ("self_attn.k_proj", "colwise"),
        ("self_attn.v_proj", "colwise"), ("self_attn.o_proj", "rowwise"),
        ("mlp.gate_proj", "colwise"), ("mlp.up_proj", "colwise"), ("mlp.down_proj", "rowwise"),
    ]
}  # fmt: skip


MAX_NORM = 0.5


def _train(
    world: int, configs: list[dict[str, Any]], evaluate: bool = False, save_to: str | None = None
) -> list[list[dict[str, Any]]]:
    configs = [{"tensor_parallel": 2, **config} for config in configs]
    return pipetrain.launch(
        cases.train, world, "llama", configs, True, evaluate, save_to, timeout_s=300,
        threads_per_worker=1,
    )  # fmt: skip


def _assert_trains_as_unpipelined(
    per_rank: list[list[dict[str, Any]]], configs: list[Any], expected: dict[str, Any] | None = None
) -> None:
    assert per_rank[0][0]["shared"] == ["lm_head.weight"]  # tied across the stages
    expected = expected or cases.reference("llama", True)
    assert_same_training(expected, per_rank, _aliases("llama"), configs)
    whole = sum(p.numel() for p in cases.hf_model("llama").parameters())
    for rank in per_rank:  # each mirror holds half of its stage's planned layers
        for result in rank:
            assert result["held"] < 0.75 * whole


@pytest.mark.slow  # 4 processes capturing a Llama
def test_a_captured_llama_on_tensor_parallel_stages_trains_as_unpipelined() -> None:
    # clipped by the global norm: split parameters' parts and whole ones each counted once
    configs = [{"schedule": "1f1b", "max_grad_norm": MAX_NORM}]
    expected = cases.reference("llama", True, max_grad_norm=MAX_NORM)
    assert min(expected["norms"]) > MAX_NORM  # the clipping clips every step
    _assert_trains_as_unpipelined(_train(4, configs), configs, expected)


@pytest.mark.slow  # 4 processes, two schedules and an evaluation (a second capture)
def test_gpipe_and_zero_bubble_on_tensor_parallel_stages_of_a_captured_llama() -> None:
    configs = [{"schedule": "gpipe"}, {"schedule": "zb-h1"}]
    per_rank = _train(4, configs, evaluate=True)
    _assert_trains_as_unpipelined(per_rank, configs)
    # eval_step afterwards: every process gets the logits of the weights it trained, as the
    # unpipelined model gives them in eval mode
    state = {k: v for rank in per_rank for k, v in rank[-1]["state"].items()}
    model = cases.hf_model("llama", seed=1)
    model.load_state_dict(state, strict=False)
    torch.testing.assert_close(model.lm_head.weight, state["model.embed_tokens.weight"])
    with torch.no_grad():
        logits = model.eval()(**cases.padded_batch(0)[0]).logits
    for rank in per_rank:
        torch.testing.assert_close(rank[-1]["evaluated"], logits, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # 8 processes
@pytest.mark.parametrize("shard", [False, True])
def test_replicas_of_tensor_parallel_stages_of_a_captured_llama(shard: bool) -> None:
    configs = [{"schedule": "1f1b", "data_parallel": 2, "shard": shard, "microbatches": 4}]
    _assert_trains_as_unpipelined(_train(8, configs), configs)


@pytest.mark.slow  # 4 processes
def test_a_checkpoint_of_tensor_parallel_stages_loads_into_the_unpipelined_llama(
    tmp_path: Path,
) -> None:
    per_rank = _train(4, [{"schedule": "1f1b"}], save_to=str(tmp_path))
    model = cases.hf_model("llama", seed=1)
    assert load_full(tmp_path / "0", model).updates == cases.STEPS
    state = model.state_dict()
    for rank in per_rank:  # each process saved its part of the split parameters
        for name, value in rank[0]["state"].items():
            assert torch.equal(state[name], value), name
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.fixture(scope="module")
def llama() -> GraphModel:
    return GraphModel(cases.hf_model("llama"), {k: v[:2] for k, v in cases.batch(0).items()})


def test_the_llama_plan_comes_from_its_config(llama: GraphModel) -> None:
    assert stage_plan(llama, [3, 3], 2, {}, owned=True) == PLAN


def _rewritten(llama: GraphModel, stage: int, plan: dict[str, str]) -> torch.fx.Graph:
    """The graph of the given block, rewritten for 2 mirrors."""
    graph = llama.segments.graph(stage, stage + 1)
    tensors = dict(llama.model.named_parameters())
    for node in graph.nodes:
        if node.op == "get_attr":
            node.meta["val"] = tensors[str(node.target)]
    GraphPass(
        graph, {k: v for k, v in plan.items() if k.startswith(f"model.layers.{stage - 1}.")}, 2
    ).run()
    return graph


def test_the_graph_pass_splits_heads_and_adds_the_two_operators(llama: GraphModel) -> None:
    graph = _rewritten(llama, 1, PLAN)
    calls = [str(n.target) for n in graph.nodes if n.op == "call_module"]
    # one copy before q, k, v (one input), one before gate and up; a reduce after o and down
    assert calls == [COPY, REDUCE, COPY, REDUCE]
    sizes = {
        n.name: [a if isinstance(a, int) else "s" for a in n.args[1]]
        for n in graph.nodes
        if n.target in (torch.ops.aten.expand.default, torch.ops.aten.reshape.default)
    }
    # 4 query heads and 2 key/value heads of 8, each repeated twice: halved on 2 mirrors
    assert sizes["expand_3"] == ["s", 1, 2, "s", 8] and sizes["reshape"] == ["s", 2, "s", 8]
    assert sizes["reshape_2"] == ["s", -1, "s", 8]  # written as -1, left alone


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ({"model.layers.0.self_attn.q_proj": "colwise"}, "query, key and value split by heads"),
        ({"model.layers.0.self_attn.o_proj": "rowwise"}, "must be a colwise layer's output"),
        (  # the MLP's down projection left whole: a linear operation on a split value
            {"model.layers.0.mlp.gate_proj": "colwise", "model.layers.0.mlp.up_proj": "colwise"},
            "linear.default.*does not follow",
        ),
    ],
)
def test_the_graph_pass_refuses_a_plan_it_cannot_follow(
    llama: GraphModel, plan: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _rewritten(llama, 1, plan)


def test_an_indivisible_head_count_or_another_style_is_refused_by_name(llama: GraphModel) -> None:
    with pytest.raises(ValueError, match="num_key_value_heads=2 does not divide by 4"):
        stage_plan(llama, [3, 3], 4, {}, owned=True)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.up_proj' is 'colwise_rep'"):
        stage_plan(llama, [3, 3], 2, {"model.layers.*.mlp.up_proj": "colwise_rep"}, owned=True)
    config = llama.model.config
    saved = config.base_model_tp_plan
    config.base_model_tp_plan = {**saved, "norm": "sequence_parallel"}
    try:
        with pytest.raises(ValueError, match=r"'model\.norm' is 'sequence_parallel'"):
            stage_plan(llama, [3, 3], 2, {}, owned=True)
    finally:
        config.base_model_tp_plan = saved
