"""A small GPT: token ids (B, T) -> logits (B, T, vocab), bytes (a vocabulary of 256) by default.

Packed rows (several documents to a row) come as ``(tokens, documents)``: ``documents``
(B, T) numbers each position's document within its row (:func:`pipetrain.data.batches.packed`);
positions then restart at each document and attention stays inside it, so a packed row
computes what its documents would one by one. The document numbers travel beside the
activations from layer to layer.

Built as an ``nn.Sequential`` of an embedding entry, one entry per transformer block and a
head entry, so every block is one pipeline layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipetrain.checks import positive_int
from pipetrain.data.batches import IGNORE_INDEX, document_positions

VOCAB_SIZE = 256


class Embedding(nn.Module):
    """Token embedding plus learned positional embedding (and optional dropout)."""

    def __init__(self, d_model: int, context: int, dropout: float, vocab: int = VOCAB_SIZE) -> None:
        """Embed ``vocab`` token ids into ``d_model`` dimensions for sequences of at most
        ``context`` tokens."""
        super().__init__()
        self.context = context
        self.token = nn.Embedding(vocab, d_model)
        self.position = nn.Embedding(context, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self, tokens: Tensor, documents: Tensor | None = None
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Map int64 token ids (B, T) to embeddings (B, T, d_model); with ``documents``,
        positions count from each document's start and the documents go on beside them."""
        length = tokens.shape[1]
        if length > self.context:
            raise ValueError(
                f"sequence length {length} exceeds the model's context {self.context}; "
                f"build the model with context >= {length} or use shorter sequences"
            )
        positions = torch.arange(length, device=tokens.device)
        if documents is None:
            return self.dropout(self.token(tokens) + self.position(positions))
        embedded = self.token(tokens) + self.position(document_positions(documents))
        return self.dropout(embedded), documents


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention using ``scaled_dot_product_attention``.

    ``qkv_by_head``'s output features are laid out head by head (each head's query, key and
    value together), so that a contiguous share of them holds whole heads: split colwise
    over tensor-parallel processes, each computes its heads' attention alone. (Its name is
    not the earlier layout's ``qkv``, so an earlier checkpoint is refused, not misread.)
    """

    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        """Attention over ``heads`` heads of size ``d_model // heads``."""
        super().__init__()
        self.heads = heads
        self.head_size = d_model // heads
        self.dropout = dropout
        self.qkv_by_head = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.proj_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, documents: Tensor | None = None) -> Tensor:
        """Attend each position to itself and earlier positions (of its own document, with
        ``documents``): (B, T, C) -> (B, T, C) (C / tp of the heads' features, split)."""
        batch, length, _ = x.shape
        # the heads this process holds: all, or its share when the projection is split colwise
        by_head = self.qkv_by_head(x).view(batch, length, -1, 3, self.head_size)
        q, k, v = (by_head[:, :, :, part].transpose(1, 2) for part in range(3))
        mask = None
        if documents is not None:
            earlier = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
            mask = (documents[:, :, None] == documents[:, None, :]) & earlier
            mask = mask[:, None]  # one mask for every head
        attended = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=mask is None,
        )
        merged = attended.transpose(1, 2).reshape(batch, length, -1)
        return self.proj_dropout(self.proj(merged))


class Block(nn.Module):
    """A pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        """A block of width ``d_model`` with a 4x wide MLP."""
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def tensor_parallel_plan(self, degree: int) -> dict[str, str]:
        """How tensor parallelism of ``degree`` splits the block: the attention's heads (its
        in-projection colwise, out-projection rowwise) and the MLP's hidden features."""
        heads = self.attn.heads
        if heads % degree:
            raise ValueError(
                f"tensor_parallel={degree} splits the GPT's attention heads, and {heads} heads "
                f"do not divide by {degree}; give a tensor_parallel that divides {heads}"
            )
        return {
            "attn.qkv_by_head": "colwise",
            "attn.proj": "rowwise",
            "mlp.0": "colwise",
            "mlp.2": "rowwise",
        }

    def forward(self, x: Tensor, documents: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Apply attention and the MLP with residual connections (the documents go on)."""
        x = x + self.attn(self.ln1(x), documents)
        x = x + self.mlp(self.ln2(x))
        return x if documents is None else (x, documents)


class Head(nn.Module):
    """Final LayerNorm and the projection to byte logits."""

    def __init__(self, d_model: int, vocab: int = VOCAB_SIZE) -> None:
        """Project ``d_model`` features to ``vocab`` logits."""
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab)

    def forward(self, x: Tensor, documents: Tensor | None = None) -> Tensor:
        """(B, T, d_model) -> logits (B, T, vocab); the document numbers end here."""
        return self.out(self.ln(x))


def build_gpt(
    d_model: int = 64,
    heads: int = 4,
    n_layers: int = 4,
    context: int = 64,
    dropout: float = 0.0,
    vocab: int = VOCAB_SIZE,
) -> nn.Sequential:
    """A GPT as ``nn.Sequential(Embedding, Block * n_layers, Head)`` (``n_layers + 2``
    entries) over a vocabulary of ``vocab`` token ids (bytes by default)."""
    if d_model < 1 or heads < 1 or d_model % heads != 0:
        raise ValueError(f"gpt d_model {d_model} must be a positive multiple of heads {heads}")
    positive_int("gpt n_layers", n_layers)
    positive_int("gpt context", context)
    positive_int("gpt vocab", vocab)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"gpt dropout {dropout} must be in [0, 1)")
    blocks = [Block(d_model, heads, dropout) for _ in range(n_layers)]
    return nn.Sequential(Embedding(d_model, context, dropout, vocab), *blocks, Head(d_model, vocab))


def gpt_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy of logits (B, T, 256) against byte targets (B, T)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def gpt_token_loss(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """The summed cross-entropy of logits (B, T, vocab) against next-token targets (B, T)
    and the count of tokens it covers: targets of ``IGNORE_INDEX`` (padding) are not counted, so the
    pipeline's loss is the mean over a step's real tokens."""
    flat = targets.reshape(-1)
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        flat,
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return total, (flat != IGNORE_INDEX).sum()
