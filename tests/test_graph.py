"""The graph front-end: stock Hugging Face models, captured and cut with no change to the
model, train as the unpipelined model does, with tied weights kept one parameter."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import graph_cases as cases
import pytest
import torch

import pipetrain
from pipetrain.checkpoint import load_full
from pipetrain.model.capture import _without_stack_traces
from pipetrain.model.graph import GraphModel

pytest.importorskip("transformers")

SCHEDULES = [
    {"schedule": "gpipe"},
    {"schedule": "1f1b", "recompute": "except_last"},
    {"schedule": "zb-h1"},
    {"schedule": "interleaved", "schedule_options": {"virtual": 2}},
]


def _aliases(name: str) -> list[set[str]]:
    """Each parameter's names in the model (two for a tied one)."""
    model = cases.hf_model(name)
    names: dict[int, set[str]] = {}
    for key, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), set()).add(key)
    return list(names.values())


def assert_same_training(
    expected: dict[str, Any],
    per_rank: list[list[dict[str, Any]]],
    aliases: list[set[str]],
    configs: list[dict[str, Any]] = SCHEDULES,
) -> None:
    """Every config's losses and final parameters and buffers equal the reference's; the
    copies of a shared parameter are bit-identical."""
    assert set(expected["state"]) <= set().union(*(r[0]["state"] for r in per_rank)) or aliases
    for index, config in enumerate(configs):
        state: dict[str, torch.Tensor] = {}
        for rank in per_rank:
            result = rank[index]
            assert result["losses"] == pytest.approx(expected["losses"], rel=1e-4), config
            for key, value in result["state"].items():
                if key in state:
                    assert torch.equal(state[key], value), (config, key)
                state[key] = value
        assert set(state) <= set(expected["state"]), set(state) - set(expected["state"])
        for names in aliases:  # every parameter of the model is held under one of its names
            assert any(n in state for n in names), names
        for key, value in state.items():
            torch.testing.assert_close(
                value, expected["state"][key], rtol=1e-4, atol=1e-5, msg=f"{config} {key}"
            )


@pytest.mark.parametrize(
    ("name", "world", "padded"),
    [
        pytest.param("gpt2", 2, False, marks=pytest.mark.slow),
        pytest.param("gpt2", 3, False, marks=pytest.mark.slow),
        ("llama", 2, True),
        pytest.param("llama", 3, True, marks=pytest.mark.slow),
        pytest.param("llama-untied", 2, True, marks=pytest.mark.slow),
        pytest.param("llama-untied", 3, True, marks=pytest.mark.slow),
    ],
)
def test_stock_causal_lm_trains_as_unpipelined(name: str, world: int, padded: bool) -> None:
    """GPT-2 on its own loss; Llama on padded batches (attention mask, -100 labels) with
    causal_lm_loss, against the model's own token mean over the whole batch."""
    per_rank = pipetrain.launch(cases.train, world, name, SCHEDULES, padded, timeout_s=240)
    tied = name != "llama-untied"
    assert bool(per_rank[0][0]["shared"]) == tied, per_rank[0][0]["shared"]
    assert_same_training(cases.reference(name, padded), per_rank, _aliases(name))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_stock_model_on_two_ranks_sharing_a_gpu_trains_as_unpipelined() -> None:
    """Llama's stages on the GPU (gloo stages messages through the host), its pair loss's
    count summed on the device, against the unpipelined model on the CPU."""
    configs = [{**config, "device": "cuda"} for config in SCHEDULES]
    per_rank = pipetrain.launch(cases.train, 2, "llama", configs, True, timeout_s=240)
    assert_same_training(cases.reference("llama", True), per_rank, _aliases("llama"), configs)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_unet_skips_cross_stages_and_train_as_unpipelined(world: int) -> None:
    per_rank = pipetrain.launch(cases.train_captured, world, "unet", SCHEDULES, timeout_s=240)
    for result in per_rank[0]:
        assert any(len(values) > 1 for values in result["crossing"]), result["crossing"]
    assert_same_training(cases.unet_reference(), per_rank, [])


@pytest.mark.slow
def test_pipedream_keeps_tied_copies_identical() -> None:
    per_rank = pipetrain.launch(cases.train_pipedream, 3, "gpt2", timeout_s=240)
    first, last = per_rank[0], per_rank[-1]
    assert first["after"] and set(first["after"]) == set(last["after"])
    for key, value in first["after"].items():
        assert torch.equal(value, last["after"][key]), key
        assert not torch.equal(value, first["before"][key]), "the tied weight was updated"
    assert all(loss == loss for loss in first["losses"])  # finite, not NaN


@pytest.mark.parametrize(
    ("world", "recompute"),
    [
        *(
            pytest.param(w, r, marks=pytest.mark.slow)
            for w, r in [(2, "never"), (2, "except_last"), (2, "always"), (3, "never")]
        ),
        pytest.param(3, "except_last", marks=pytest.mark.slow),
        pytest.param(3, "always", marks=pytest.mark.slow),
    ],
)
def test_resnet_batch_norm_trains_as_unpipelined_micro_batch_by_micro_batch(
    world: int, recompute: str
) -> None:
    configs = [{**config, "recompute": recompute} for config in SCHEDULES]
    per_rank = pipetrain.launch(cases.train_captured, world, "resnet", configs, timeout_s=240)
    assert_same_training(cases.resnet_reference(2 * world), per_rank, [], configs)


@pytest.mark.slow
def test_a_tied_models_checkpoint_loads_into_the_unpipelined_model(tmp_path: Path) -> None:
    per_rank = pipetrain.launch(cases.save_tied, 2, str(tmp_path), timeout_s=240)
    model = cases.hf_model("gpt2", seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cases.LR)
    load_full(tmp_path, model, optimizer)
    state = model.state_dict()
    assert model.lm_head.weight is model.transformer.wte.weight, "still tied after loading"
    for rank in per_rank:
        for key, value in rank.items():
            assert torch.equal(state[key], value), key
    assert len(optimizer.state) == len(list(model.parameters()))


@pytest.mark.slow
def test_a_meta_model_trains_from_a_weights_file_as_the_unpipelined_one(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model = cases.hf_model("gpt2")
    path = tmp_path / "model.safetensors"  # tied names saved once, as Hugging Face does
    save_file({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, path)
    per_rank = pipetrain.launch(cases.train_meta, 2, "gpt2", str(path), timeout_s=240)
    expected = cases.reference("gpt2")
    assert_same_training(expected, [[r] for r in per_rank], _aliases("gpt2"), [{}])


def test_a_model_given_as_layers_keeps_its_tied_weight_one_parameter() -> None:
    per_rank = pipetrain.launch(cases.train_sequential, 2, SCHEDULES, timeout_s=240)
    assert per_rank[0][0]["shared"] == ["0.weight"]
    aliases = [{"0.weight", "4.weight"}]
    assert_same_training(cases.sequential_reference(), per_rank, aliases)


class _AutocastRegion(torch.nn.Module):
    """Two blocks, the second under autocast, which export keeps as a graph of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.blocks[1](x) + torch.arange(4, device=x.device)
        return y.float()


def test_a_stage_placed_on_a_device_names_only_it_inside_an_autocast_region() -> None:
    """The region's own graph makes and checks tensors on the capture's device: a stage
    placed elsewhere must name its own there too (and the region's device type)."""
    model, x = _AutocastRegion(), torch.randn(3, 4)
    graph = GraphModel(model, x[:2])
    placed = graph.stage(0, len(graph.names), device=torch.device("meta"))
    regions = [m for m in placed.modules() if isinstance(m, torch.fx.GraphModule)]
    assert len(regions) == 1, placed
    assert "cpu" not in placed.code and "cpu" not in regions[0].code
    assert "wrap_with_autocast('meta'" in placed.code
    assert "cpu" in graph.captured.module.code  # other stages are placed from the capture
    on_cpu = graph.stage(0, len(graph.names), device=torch.device("cpu"))
    torch.testing.assert_close(on_cpu(x)[0], model(x))


@pytest.mark.parametrize("setting", [None, False, True])
def test_the_capture_turns_stack_traces_off_only_where_torch_has_the_setting(
    setting: bool | None,
) -> None:
    """Torch before 2.13 has no ``do_not_emit_stack_traces``: the capture must not need
    it; where it exists it is on during the capture and as it was after."""
    config = (
        types.SimpleNamespace()
        if setting is None
        else types.SimpleNamespace(do_not_emit_stack_traces=setting)
    )
    with _without_stack_traces(config):
        assert getattr(config, "do_not_emit_stack_traces", True) is True
    assert vars(config) == ({} if setting is None else {"do_not_emit_stack_traces": setting})
