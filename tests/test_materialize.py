"""Stage modules built on the meta device: allocated and initialized by materialize() from
their modules' reset methods, an init function, a state dict or a weights file; and a
pipeline of a meta model loaded from a safetensors file training as the ordinary model."""

from __future__ import annotations

from pathlib import Path

import materialize_cases
import pytest
import torch
import training_cases as cases
from pipeline_cases import mlp
from safetensors.torch import save_file
from torch import nn

import pipetrain
from pipetrain.model.layers import StageModule, to_layers
from pipetrain.model.materialize import materialize


def model(seed: int = 0) -> nn.Sequential:
    """Embedding, LayerNorm, Linear and BatchNorm: reset methods of several kinds."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(7, 4), nn.LayerNorm(4), nn.Linear(4, 6), nn.BatchNorm1d(6))


def meta_model() -> nn.Sequential:
    with torch.device("meta"):
        return model()


def stage(built: nn.Sequential, start: int, stop: int) -> StageModule:
    return StageModule(to_layers(built)[start:stop])


def assert_equal_state(got: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    state = got.state_dict()
    assert sorted(state) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(state[name], value), name


class Rotary(nn.Module):
    """A non-persistent buffer computed at construction, as rotary embeddings hold."""

    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.register_buffer(
            "inv_freq", 1 / 10 ** (torch.arange(0, dim, 2) / dim), persistent=False
        )

    def reset_parameters(self) -> None:
        self.inv_freq.copy_(1 / 10 ** (torch.arange(0, self.inv_freq.numel() * 2, 2) / 4))


class Scale(nn.Module):
    """A parameter its module has no method to reset."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(3))


class Masked(nn.Linear):
    """A Linear whose reset_parameters() leaves its non-persistent mask alone."""

    def __init__(self) -> None:
        super().__init__(3, 3)
        self.register_buffer("mask", torch.tril(torch.ones(3, 3)), persistent=False)


def test_reset_methods_initialize_as_a_model_built_normally_with_the_same_seed() -> None:
    built = meta_model()
    torch.manual_seed(0)  # the reset methods draw in the order the constructors did
    materialize(built, "cpu")
    assert not any(t.is_meta for t in [*built.parameters(), *built.buffers()])
    assert_equal_state(built, model().state_dict())


def test_init_fn_sets_the_stage_and_replaces_the_reset_methods() -> None:
    calls: list[nn.Module] = []

    def init(module: nn.Module) -> None:
        calls.append(module)
        for tensor in [*module.parameters(), *module.buffers()]:
            nn.init.constant_(tensor, 0.5)

    part = stage(meta_model(), 1, 3)
    materialize(part, "cpu", init_fn=init)
    assert calls == [part]
    assert sorted(part.state_dict()) == ["1.bias", "1.weight", "2.bias", "2.weight"]
    assert all(torch.equal(v, torch.full_like(v, 0.5)) for v in part.state_dict().values())


@pytest.mark.parametrize("kind", ["state dict", ".safetensors", ".pt"])
def test_weights_give_exactly_the_stage_entries_of_the_saved_model(
    kind: str, tmp_path: Path
) -> None:
    saved = model(seed=3).state_dict()
    weights: dict[str, torch.Tensor] | Path = saved
    if kind == ".safetensors":
        save_file(saved, weights := tmp_path / "model.safetensors")
    elif kind == ".pt":
        torch.save(saved, weights := tmp_path / "model.pt")
    part = materialize(stage(meta_model(), 2, 4), "cpu", weights=weights)
    assert_equal_state(part, {k: v for k, v in saved.items() if k[0] in "23"})


def test_missing_entries_are_named_with_the_file(tmp_path: Path) -> None:
    saved = model().state_dict()
    del saved["3.running_var"], saved["2.bias"]
    save_file(saved, path := tmp_path / "partial.safetensors")
    with pytest.raises(ValueError, match="lacks 2 of the module's entries") as error:
        materialize(stage(meta_model(), 2, 4), "cpu", weights=path)
    assert "'2.bias', '3.running_var'" in str(error.value)
    assert "partial.safetensors" in str(error.value)


def test_an_entry_of_another_shape_is_refused() -> None:
    saved = model().state_dict() | {"2.bias": torch.zeros(5)}
    with pytest.raises(ValueError, match=r"'2.bias' of shape \[5\], but the module's is \[6\]"):
        materialize(stage(meta_model(), 2, 3), "cpu", weights=saved)


def test_a_file_of_an_unknown_kind_is_refused(tmp_path: Path) -> None:
    (path := tmp_path / "model.npz").write_bytes(b"")
    with pytest.raises(ValueError, match=r"model.npz' is neither a \.safetensors file"):
        materialize(meta_model(), "cpu", weights=path)


def test_a_missing_file_and_a_file_without_a_state_dict_are_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"absent\.safetensors' does not exist"):
        materialize(meta_model(), "cpu", weights=tmp_path / "absent.safetensors")
    torch.save({"model": model().state_dict(), "step": 3}, path := tmp_path / "run.pt")
    with pytest.raises(ValueError, match=r"run\.pt' holds a dict, not a state dict of tensors"):
        materialize(meta_model(), "cpu", weights=path)


def test_a_parameter_without_a_reset_method_names_its_module() -> None:
    with torch.device("meta"):
        built = nn.Sequential(nn.Linear(3, 3), Scale())
    with pytest.raises(ValueError, match=r"parameter '1.gain' of module '1' \(Scale, which has"):
        materialize(built, "cpu")
    with torch.device("meta"):
        built = nn.Sequential(nn.Linear(3, 3), Scale())

    def init(module: nn.Module) -> None:  # init_fn sets every tensor
        module[0].reset_parameters()
        nn.init.ones_(module[1].gain)

    materialize(built, "cpu", init_fn=init)
    assert torch.equal(built[1].gain, torch.ones(3))


def test_non_persistent_buffers_are_reset_by_their_module_or_named() -> None:
    with torch.device("meta"):
        built = nn.Sequential(Rotary(), Masked())
    with pytest.raises(ValueError) as error:
        materialize(built, "cpu", weights=nn.Sequential(Rotary(), Masked()).state_dict())
    message = str(error.value)
    assert "buffer '1.mask' (non-persistent" in message
    assert "whose reset_parameters() left them unset" in message
    assert "inv_freq" not in message  # Rotary.reset_parameters() recomputed it
    assert torch.equal(built[0].inv_freq, Rotary().inv_freq)


def test_tied_parameters_stay_one_tensor(tmp_path: Path) -> None:
    def tied() -> nn.Sequential:
        embed, head = nn.Embedding(7, 4), nn.Linear(4, 7, bias=False)
        head.weight = embed.weight
        return nn.Sequential(embed, nn.Tanh(), head)

    with torch.device("meta"):
        built = tied()
    materialize(built, "cpu")
    assert built[0].weight is built[2].weight
    # a file holds a tied tensor once, as Hugging Face checkpoints do
    save_file({"0.weight": torch.arange(28.0).view(7, 4)}, path := tmp_path / "tied.safetensors")
    with torch.device("meta"):
        built = tied()
    materialize(built, "cpu", weights=path)
    assert built[0].weight is built[2].weight
    assert torch.equal(built[2].weight, torch.arange(28.0).view(7, 4))


def test_an_init_fn_that_unties_is_refused() -> None:
    with torch.device("meta"):
        embed, head = nn.Embedding(7, 4), nn.Linear(4, 7, bias=False)
    head.weight = embed.weight

    def untie(module: nn.Module) -> None:
        module[0].weight = nn.Parameter(torch.zeros(7, 4))
        module[1].weight = nn.Parameter(torch.zeros(7, 4))

    with pytest.raises(ValueError, match=r"tied names '0\.weight', '1\.weight' no longer share"):
        materialize(nn.Sequential(embed, head), "cpu", init_fn=untie)


def test_a_module_not_on_the_meta_device_keeps_its_values() -> None:
    built = model()
    expected = {k: v.clone() for k, v in built.state_dict().items()}
    assert materialize(built, "cpu") is built
    assert_equal_state(built, expected)


def test_hugging_face_rotary_embedding_needs_the_models_init_weights() -> None:
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    config = llama.LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_hidden_layers=1,
        vocab_size=32,
    )
    with torch.device("meta"):
        meta = llama.LlamaModel(config)
    with pytest.raises(ValueError, match=r"buffer 'rotary_emb.inv_freq' \(non-persistent"):
        materialize(meta, "cpu", weights=llama.LlamaModel(config).state_dict())
    with torch.device("meta"):
        meta = llama.LlamaModel(config)
    materialize(meta, "cpu", init_fn=lambda module: module.apply(meta._init_weights))
    expected = llama.LlamaModel(config)
    assert torch.equal(meta.rotary_emb.inv_freq, expected.rotary_emb.inv_freq)
    assert torch.equal(meta.norm.weight, torch.ones(16))


def test_a_meta_model_loaded_from_safetensors_trains_as_the_ordinary_model(
    tmp_path: Path,
) -> None:
    save_file(mlp().state_dict(), path := tmp_path / "mlp.safetensors")
    results = pipetrain.launch(materialize_cases.meta_loop, 2, str(path), timeout_s=300)
    expected = cases.reference_loop()
    state: dict[str, torch.Tensor] = {}
    for result in results:
        assert result["losses"] == pytest.approx(expected["losses"], rel=1e-5)
        assert result["real"] == sorted(result["state"])  # only its own stage allocated
        state.update(result["state"])
    assert sorted(state) == sorted(expected["state"])
    for name, value in expected["state"].items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_an_init_fn_that_leaves_tensors_unset_in_whole_or_in_part_is_refused() -> None:
    with torch.device("meta"):
        built = nn.Sequential(nn.Linear(3, 3), Scale())
    with pytest.raises(ValueError, match=r"parameter '1.gain' of module '1' \(Scale, which init"):
        materialize(built, "cpu", init_fn=lambda m: m[0].reset_parameters())

    def half(module: nn.Module) -> None:
        module[0].reset_parameters()
        with torch.no_grad():
            module[1].gain[:2] = 1.0

    with torch.device("meta"):
        built = nn.Sequential(nn.Linear(3, 3), Scale())
    with pytest.raises(ValueError, match=r"'1.gain'.*in whole or in part"):
        materialize(built, "cpu", init_fn=half)

    def through_data(module: nn.Module) -> None:  # moves no version counter
        module[0].weight.data.normal_()
        module[0].bias.data.zero_()
        module[1].gain.data.fill_(2.0)

    with torch.device("meta"):
        built = nn.Sequential(nn.Linear(3, 3), Scale())
    materialize(built, "cpu", init_fn=through_data)
    assert torch.equal(built[1].gain, torch.full((3,), 2.0))


def _hf_decoder(family: str, meta: bool = False) -> nn.Module:
    """A tiny stock decoder of ``family`` (on the meta device if ``meta``)."""
    import transformers

    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
        "phi": (transformers.PhiConfig, transformers.PhiForCausalLM),
    }[family]
    config = config_class(
        num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=32, max_position_embeddings=32, head_dim=8,
    )  # fmt: skip
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return model_class(config)
    return model_class(config)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma", "phi"])
def test_the_readme_recipe_initializes_every_tensor_of_a_captured_stage(family: str) -> None:
    """``init_fn=lambda stage: stage.apply(model._init_weights)`` on each stage of a
    captured Hugging Face decoder: the rotary tables as the model computes them, every
    tensor set; leaving the recipe out is refused naming the rotary table."""
    pytest.importorskip("transformers")
    from pipetrain.model.graph import GraphModel

    meta, expected = _hf_decoder(family, meta=True), _hf_decoder(family)
    graph = GraphModel(meta, {"input_ids": torch.randint(0, 32, (2, 8))})
    buffers = dict(expected.named_buffers())
    cpu = torch.device("cpu")
    for start, stop in [(0, 1), (1, len(graph.names))]:
        part = materialize(
            graph.stage(start, stop, cpu), cpu, init_fn=lambda s: s.apply(meta._init_weights)
        )
        for name, tensor in [*part.named_parameters(), *part.named_buffers()]:
            assert not tensor.is_floating_point() or not tensor.isnan().any(), name
            if name in buffers:
                torch.testing.assert_close(tensor, buffers[name], msg=name)
    with pytest.raises(ValueError, match=r"rotary_emb.inv_freq"):
        materialize(graph.stage(0, 1, cpu), cpu, weights=expected.state_dict())


def _sharded_gpt2(directory: Path) -> nn.Module:
    """A tiny GPT-2 saved by save_pretrained in shards of at most 4 kB."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0
    )
    saved = GPT2LMHeadModel(config)
    saved.save_pretrained(directory, max_shard_size="4kB")
    return saved


def test_weights_come_from_a_save_pretrained_directory_or_its_index(tmp_path: Path) -> None:
    """A directory (sharded here) or its ``model.safetensors.index.json`` give each
    stage exactly its entries; shards holding none of them are never opened."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    from pipetrain.model.graph import GraphModel

    saved = _sharded_gpt2(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    assert index.is_file() and len(list(tmp_path.glob("model-*.safetensors"))) > 2
    with torch.device("meta"):
        config = GPT2Config(
            n_layer=2, n_embd=16, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0
        )
        meta = GPT2LMHeadModel(config)
    graph = GraphModel(meta, {"input_ids": torch.randint(0, 64, (2, 8))})
    expected = saved.state_dict()
    cpu = torch.device("cpu")
    for weights in (tmp_path, index, str(tmp_path)):
        part = materialize(graph.stage(1, 2, cpu), cpu, weights=weights)
        state = part.state_dict()
        assert state and all(torch.equal(v, expected[k]) for k, v in state.items())
    import json

    weight_map = json.loads(index.read_text())["weight_map"]
    needed = {weight_map[k] for k in graph.stage(1, 2).state_dict()}
    for shard in tmp_path.glob("model-*.safetensors"):
        if shard.name not in needed:
            shard.write_bytes(b"not a shard")
    part = materialize(graph.stage(1, 2, cpu), cpu, weights=tmp_path)
    assert all(torch.equal(v, expected[k]) for k, v in part.state_dict().items())


def test_a_directory_without_weights_is_refused_naming_what_it_looked_for(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"holds none of model.safetensors.index.json"):
        materialize(meta_model(), "cpu", weights=tmp_path)
    save_file(model(seed=3).state_dict(), tmp_path / "model.safetensors")
    built = materialize(meta_model(), "cpu", weights=tmp_path)
    assert_equal_state(built, model(seed=3).state_dict())


def test_the_readme_recipe_trains_a_meta_llama_with_its_rotary_tables() -> None:
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    expected = dict(LlamaForCausalLM(materialize_cases.llama_config()).named_buffers())
    results = pipetrain.launch(materialize_cases.meta_llama_recipe, 2, timeout_s=300)
    held = [name for result in results for name in result["buffers"]]
    assert "model.rotary_emb.inv_freq" in held
    for result in results:
        assert all(loss == loss and 0 < loss < 10 for loss in result["losses"])
        for name, value in result["buffers"].items():
            torch.testing.assert_close(value, expected[name], msg=name)
