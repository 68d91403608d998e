"""Worker functions for the model zoo (importable by spawned workers): tiny stock Hugging
Face models of many architectures, each captured, trained on 2 ranks, evaluated, saved on
one balance and loaded on another, and the unpipelined runs they are compared with."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from settings import make_pipeline
from torch import nn

from pipetrain.model.graph import GraphModel

BATCH, LENGTH, VOCAB, STEPS, LR = 4, 8, 48, 2, 0.1
MICROBATCHES = 2

logging.getLogger("transformers").setLevel(logging.ERROR)

_DECODER = dict(
    num_hidden_layers=2,
    hidden_size=16,
    intermediate_size=32,
    num_attention_heads=2,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=32,
)


def _text(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (BATCH, LENGTH), generator=generator)
    return {"input_ids": ids, "labels": ids.clone()}


def _images(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(BATCH, 3, 16, 16, generator=generator)
    return {"pixel_values": pixels, "labels": torch.randint(0, 3, (BATCH,), generator=generator)}


def _build(name: str) -> nn.Module:
    import transformers as tf

    if name == "bert":
        return tf.BertForMaskedLM(
            tf.BertConfig(
                num_hidden_layers=2,
                hidden_size=16,
                num_attention_heads=2,
                intermediate_size=32,
                vocab_size=VOCAB,
                max_position_embeddings=32,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
        )
    if name == "t5":
        return tf.T5ForConditionalGeneration(
            tf.T5Config(
                vocab_size=VOCAB,
                d_model=16,
                d_kv=8,
                d_ff=32,
                num_layers=2,
                num_decoder_layers=2,
                num_heads=2,
                dropout_rate=0.0,
                pad_token_id=0,
                decoder_start_token_id=0,
            )
        )
    if name == "gpt2":
        return tf.GPT2LMHeadModel(
            tf.GPT2Config(
                n_layer=2,
                n_embd=16,
                n_head=2,
                vocab_size=VOCAB,
                n_positions=32,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        )
    if name == "gpt_neox":
        return tf.GPTNeoXForCausalLM(
            tf.GPTNeoXConfig(**_DECODER, attention_dropout=0.0, hidden_dropout=0.0)
        )
    decoders: dict[str, tuple[Any, Any, dict[str, Any]]] = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {}),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
        "phi": (tf.PhiConfig, tf.PhiForCausalLM, {"resid_pdrop": 0.0, "embd_pdrop": 0.0}),
        "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, {"head_dim": 8}),
        "mixtral": (
            tf.MixtralConfig,
            tf.MixtralForCausalLM,
            {"num_local_experts": 4, "num_experts_per_tok": 2},
        ),
        "qwen2_moe": (
            tf.Qwen2MoeConfig,
            tf.Qwen2MoeForCausalLM,
            {
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 16,
                "shared_expert_intermediate_size": 16,
            },
        ),
    }
    if name in decoders:
        config_class, model_class, extra = decoders[name]
        return model_class(config_class(**_DECODER, **extra))
    vision: dict[str, Callable[[], nn.Module]] = {
        "vit": lambda: tf.ViTForImageClassification(
            tf.ViTConfig(
                image_size=16,
                patch_size=4,
                num_hidden_layers=2,
                hidden_size=16,
                num_attention_heads=2,
                intermediate_size=32,
                num_labels=3,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
        ),
        "resnet": lambda: tf.ResNetForImageClassification(
            tf.ResNetConfig(
                embedding_size=8,
                hidden_sizes=[8, 16],
                depths=[1, 1],
                num_labels=3,
                layer_type="basic",
            )
        ),
        "convnext": lambda: tf.ConvNextForImageClassification(
            tf.ConvNextConfig(
                num_channels=3,
                patch_size=2,
                hidden_sizes=[8, 16],
                depths=[1, 1],
                num_stages=2,
                num_labels=3,
                image_size=16,
            )
        ),
    }
    return vision[name]()


VISION = ("vit", "resnet", "convnext")
ZOO = (
    "bert",
    "t5",
    "gpt2",
    "llama",
    "mistral",
    "qwen2",
    "gpt_neox",
    "phi",
    "gemma",
    "mixtral",
    "qwen2_moe",
    *VISION,
)
"""Encoder, encoder-decoder, decoders (tied: gpt2, gemma; MoE: mixtral, qwen2_moe), vision."""


def build(name: str, seed: int = 0) -> nn.Module:
    """The tiny stock model ``name``, seeded, in training mode."""
    torch.manual_seed(seed)
    return _build(name).train()


def batch(name: str, step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s inputs with their labels (the model's own loss)."""
    return _images(step) if name in VISION else _text(step)


def reference(name: str) -> dict[str, Any]:
    """The unpipelined model trained STEPS steps on its own loss, micro-batch by
    micro-batch (as the pipeline splits a batch; batch statistics per micro-batch), each
    loss weighted by its share of the samples; then its eval-mode outputs."""
    model = build(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        inputs, total = batch(name, step), 0.0
        for k in range(MICROBATCHES):
            part = {key: v.tensor_split(MICROBATCHES)[k] for key, v in inputs.items()}
            loss = model(**part).loss * len(part["labels"]) / BATCH
            loss.backward()
            total += loss.item()
        optimizer.step()
        losses.append(total)
    model.eval()
    with torch.no_grad():
        evaluated = model(**batch(name, 99))
    return {
        "losses": losses,
        "state": model.state_dict(),
        "eval_loss": evaluated.loss,
        "eval_logits": evaluated.logits,
    }


def _pipeline(name: str, model: nn.Module | GraphModel, balance: list[int] | None) -> Any:
    sample = {k: v[:2] for k, v in batch(name, 0).items()}
    return make_pipeline(
        model,
        example_inputs=sample,
        balance=balance,
        schedule="1f1b",
        microbatches=MICROBATCHES,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9),
        timeout_s=300,
    )


def _state(pipe: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in pipe.state_dict().items()}


def zoo_run(name: str, directory: str) -> dict[str, Any]:
    """``name`` trained STEPS steps on its default balance, evaluated, saved, and one
    step more; then loaded into a pipeline of another balance, which takes that step too."""
    model = build(name)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    graph = GraphModel(model, {k: v[:2] for k, v in batch(name, 0).items()})
    pipe = _pipeline(name, graph, None)
    losses = [pipe.train_step(batch(name, step)) for step in range(STEPS)]
    evaluated = pipe.eval_step(batch(name, 99))
    trained = _state(pipe)
    pipe.save(directory)
    # the pipelines share the model's tensors: one runs after the other
    after = [pipe.train_step(batch(name, STEPS))]
    segments = len(graph.names)
    other = [1, segments - 1] if pipe.balance[0] != 1 else [segments - 1, 1]
    model.load_state_dict(initial)  # the second pipeline starts elsewhere, then loads
    moved = _pipeline(name, graph, other)
    moved.load(directory)
    loaded = _state(moved)
    after.append(moved.train_step(batch(name, STEPS)))
    return {
        "losses": losses,
        "state": trained,
        "eval_loss": evaluated.loss,
        "eval_logits": evaluated.logits,
        "balances": (pipe.balance, moved.balance),
        "loaded": loaded,
        "after": after,
        "model_keys": sorted(model.state_dict()),
    }


def move_checkpoint(name: str, directory: str) -> dict[str, Any]:
    """``name`` trained on one balance and saved, then loaded into every other balance of
    two stages, each taking one more step: this rank's state after each load, and the
    losses of that step, the first of them the saving pipeline's."""
    model = build(name)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    graph = GraphModel(model, {k: v[:2] for k, v in batch(name, 0).items()})
    first = [1, len(graph.names) - 1]
    pipe = _pipeline(name, graph, first)
    for step in range(STEPS):
        pipe.train_step(batch(name, step))
    saved = _state(pipe)
    pipe.save(directory)
    results = {"saved": saved, "balances": [first], "loaded": [], "losses": []}
    results["losses"].append(pipe.train_step(batch(name, STEPS)))
    for cut in range(2, len(graph.names)):
        model.load_state_dict(initial)
        moved = _pipeline(name, graph, [cut, len(graph.names) - cut])
        moved.load(directory)
        results["balances"].append(moved.balance)
        results["loaded"].append(_state(moved))
        results["losses"].append(moved.train_step(batch(name, STEPS)))
    return results


def exported_round_trip(name: str, directory: str, out: str) -> dict[str, Any]:
    """The checkpoint in ``directory`` exported, written by save_pretrained from a fresh
    model and read back by from_pretrained: its loading info and state."""
    from pipetrain.checkpoint import export

    export(directory, out)
    state = torch.load(out, weights_only=True)["model"]
    fresh = build(name, seed=1)
    target = Path(out).with_suffix("")
    fresh.save_pretrained(target, state_dict=dict(state))  # it drops tied names in place
    loaded, info = type(fresh).from_pretrained(target, output_loading_info=True)
    return {"info": info, "state": loaded.state_dict(), "exported": state}
