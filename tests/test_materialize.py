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
    materialize(built, "cpu", init_fn=lambda m: nn.init.ones_(m[1].gain))  # covered
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
    results = pipetrain.launch(materialize_cases.meta_loop, 2, str(path), timeout_s=60)
    expected = cases.reference_loop()
    state: dict[str, torch.Tensor] = {}
    for result in results:
        assert result["losses"] == pytest.approx(expected["losses"], rel=1e-5)
        assert result["real"] == sorted(result["state"])  # only its own stage allocated
        state.update(result["state"])
    assert sorted(state) == sorted(expected["state"])
    for name, value in expected["state"].items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
