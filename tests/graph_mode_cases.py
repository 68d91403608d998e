"""Worker functions for the tests of a captured model's modes, guards and evaluation
(importable by spawned workers), and the unpipelined runs they are compared with."""

from __future__ import annotations

import logging
from typing import Any

import torch
from settings import make_pipeline
from torch import nn

from pipetrain.model.graph import GraphModel

BATCH, WIDTH, LR = 8, 8, 0.1

logging.getLogger("transformers").setLevel(logging.ERROR)


class ModeBlock(nn.Module):
    """Batch normalization and a branch on ``self.training``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.BatchNorm1d(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.linear(x))
        if self.training:
            y = y * 0.5
        return x + torch.tanh(y)


class ModeNet(nn.Module):
    """Four mode-dependent blocks and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ModeBlock() for _ in range(4))
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def mode_net() -> ModeNet:
    torch.manual_seed(0)
    return ModeNet()


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, WIDTH, generator=generator)
    return x, torch.randint(0, 3, (BATCH,), generator=generator)


MODES = [True, True, False, True]
"""The mode of each training step: the third runs in eval mode (frozen statistics)."""


def mode_reference() -> dict[str, Any]:
    """The unpipelined model trained in MODES' modes, two micro-batches a step (batch
    statistics per micro-batch), then its eval-mode outputs on a batch."""
    model = mode_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step, training in enumerate(MODES):
        model.train(training)
        optimizer.zero_grad()
        x, y = data(step)
        total = 0.0
        for xs, ys in zip(x.tensor_split(2), y.tensor_split(2)):
            loss = nn.functional.cross_entropy(model(xs), ys) / 2
            loss.backward()
            total += loss.item()
        optimizer.step()
        losses.append(total)
    model.eval()
    with torch.no_grad():
        evaluated = model(data(99)[0])
    return {"losses": losses, "state": model.state_dict(), "evaluated": evaluated}


def train_modes() -> dict[str, Any]:
    """ModeNet handed over in eval mode (as ``from_pretrained`` returns models), trained
    in MODES' modes through ``pipe.train()``/``pipe.eval()``, then evaluated."""
    model = mode_net().eval()
    pipe = make_pipeline(
        model,
        example_inputs=data(0)[0][:2],
        microbatches=2,
        loss_fn=nn.functional.cross_entropy,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=LR),
        timeout_s=300,
    )
    losses, modes = [], []
    for step, training in enumerate(MODES):
        pipe.train(training)
        modes.append(pipe.training)
        losses.append(pipe.train_step(*data(step)))
    evaluated = pipe.eval_step(data(99)[0])
    still = pipe.training  # eval_step leaves the mode as it was
    state = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
    return {
        "losses": losses,
        "modes": modes,
        "state": state,
        "evaluated": evaluated,
        "still": still,
    }


def hf_dropout_model(name: str) -> nn.Module:
    """A tiny stock model with every dropout on: ``gpt2`` (causal LM, own loss) or
    ``bert`` (masked LM)."""
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    if name == "gpt2":
        config = GPT2Config(
            n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=16,
            resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return GPT2LMHeadModel(config)
    config = BertConfig(
        num_hidden_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=32,
        vocab_size=32, max_position_embeddings=16, hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )  # fmt: skip
    return BertForMaskedLM(config)


def tokens(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 32, (4, 8), generator=generator)
    return {"input_ids": ids, "labels": ids.clone()}


def evaluate_hf(name: str) -> dict[str, Any]:
    """Two eval_steps with the labels, one without, of ``name`` trained one step on its
    own loss (dropout on), and the unpipelined model's eval-mode outputs after the same
    step taken on the pipeline's weights."""
    model = hf_dropout_model(name)
    pipe = make_pipeline(
        model,
        example_inputs={k: v[:2] for k, v in tokens(0).items()},
        microbatches=2,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=LR),
        timeout_s=300,
    )
    pipe.train_step(tokens(0))
    batch = tokens(1)
    first, second = pipe.eval_step(batch), pipe.eval_step(batch)
    logits_only = pipe.eval_step({"input_ids": batch["input_ids"]})
    return {
        "state": {k: v.detach().clone() for k, v in pipe.state_dict().items()},
        "first": (first.loss, first.logits),
        "second": (second.loss, second.logits),
        "logits_only": (logits_only.get("loss"), logits_only.logits),
    }


class LengthBranch(nn.Module):
    """A branch on the sequence length, which export records as a guard."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        if x.shape[1] > 8:
            x = x * 2
        return x.mean(1)


def guarded(length: int, evaluate: bool) -> str:
    """LengthBranch captured at length 8, run at ``length``: '' or the error's message."""
    torch.manual_seed(0)
    pipe = make_pipeline(
        LengthBranch(),
        example_inputs=torch.randn(2, 8, 4),
        microbatches=2,
        loss_fn=nn.functional.mse_loss,
        timeout_s=300,
    )
    x = torch.randn(4, length, 4)
    try:
        if evaluate:
            pipe.eval_step(x)
        else:
            pipe.train_step(x, torch.zeros(4, 4))
    except Exception as error:  # the message is what the test reads
        return str(error)
    return ""


def split_graph() -> list[str]:
    """A ModeNet captured once, then pipelined at a split point: this rank's parameters."""
    graph = GraphModel(mode_net(), data(0)[0][:2])
    pipe = make_pipeline(
        graph,
        split_points=["blocks.3"],
        microbatches=2,
        loss_fn=nn.functional.cross_entropy,
        timeout_s=300,
    )
    return sorted(name for name, _ in pipe.named_parameters())


def evaluate_logits(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Two eval_steps of ``name`` (every dropout on) captured on its token ids alone,
    trained with a loss function of its own."""
    model = hf_dropout_model(name)
    ids = tokens(1)["input_ids"]
    pipe = make_pipeline(
        model,
        example_inputs={"input_ids": ids[:2]},
        microbatches=2,
        loss_fn=lambda output, target: nn.functional.mse_loss(output.logits, target),
        timeout_s=300,
    )
    first, second = pipe.eval_step({"input_ids": ids}), pipe.eval_step({"input_ids": ids})
    return first.logits, second.logits
