"""Stock Hugging Face causal LMs for the byte-level corpus: ``hf-gpt2`` and ``hf-llama``.

Small configurations built from ``transformers`` classes as they are (no download, no
change to the model), with a 256-token vocabulary, tied input and output embeddings and no
dropout. Install ``transformers`` with ``pip install pipetrain[hf]``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn

from pipetrain.app.models.gpt import gpt_loss

VOCAB = 256  # bytes


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise ImportError(
            "the hf-* models need transformers: pip install 'pipetrain[hf]'"
        ) from error
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return transformers


def build_hf_gpt2(
    d_model: int = 64, heads: int = 4, n_layers: int = 4, context: int = 64
) -> nn.Module:
    """A ``GPT2LMHeadModel`` (tied embeddings)."""
    hf = _transformers()
    config = hf.GPT2Config(
        n_layer=n_layers, n_embd=d_model, n_head=heads, vocab_size=VOCAB, n_positions=context,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model: nn.Module = hf.GPT2LMHeadModel(config)
    return model


def build_hf_llama(
    d_model: int = 64, heads: int = 4, n_layers: int = 4, context: int = 64
) -> nn.Module:
    """A ``LlamaForCausalLM`` (rotary positions, grouped-query attention, tied embeddings)."""
    hf = _transformers()
    config = hf.LlamaConfig(
        num_hidden_layers=n_layers, hidden_size=d_model, intermediate_size=4 * d_model,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), vocab_size=VOCAB,
        max_position_embeddings=context, tie_word_embeddings=True, bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model: nn.Module = hf.LlamaForCausalLM(config)
    return model


def hf_loss(output: Any, targets: Tensor) -> Tensor:
    """Mean cross-entropy of the model's ``logits`` against byte targets (B, T)."""
    return gpt_loss(output.logits if not isinstance(output, Tensor) else output, targets)


def hf_example(context: int = 64) -> Tensor:
    """A sample of the inputs the models are captured on: 2 windows of byte ids."""
    return torch.zeros(2, context, dtype=torch.int64)
