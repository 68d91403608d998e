"""Worker functions for the graph front-end tests (importable by spawned workers): stock
Hugging Face models captured as graphs, and the unpipelined runs they are compared with."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from settings import make_pipeline

import pipetrain
from pipetrain.model.graph import GraphModel

VOCAB, LENGTH, BATCH, STEPS, LR = 64, 8, 12, 3, 0.5

logging.getLogger("transformers").setLevel(logging.ERROR)


def hf_model(name: str, seed: int = 0, context: int = 64) -> torch.nn.Module:
    """A small stock Hugging Face causal LM: ``gpt2`` (tied), ``llama`` (tied),
    ``llama-untied`` (positions up to ``context``); 4 blocks, no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if name == "gpt2":
        config = GPT2Config(
            n_layer=4, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return GPT2LMHeadModel(config)
    config = LlamaConfig(
        num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=context,
        tie_word_embeddings=name == "llama", bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def batch(seed: int) -> dict[str, torch.Tensor]:
    """Token ids with their labels (the model shifts them itself)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (BATCH, LENGTH), generator=generator)
    return {"input_ids": ids, "labels": ids.clone()}


def padded_batch(seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Right-padded sequences of uneven lengths with their attention mask, and labels that
    ignore (-100) the padding and some tokens besides."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (BATCH, LENGTH), generator=generator)
    lengths = torch.randint(2, LENGTH + 1, (BATCH,), generator=generator)
    mask = (torch.arange(LENGTH) < lengths[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    labels[torch.rand(BATCH, LENGTH, generator=generator) < 0.2] = -100
    return {"input_ids": ids * mask, "attention_mask": mask}, labels


def reference(
    name: str, padded: bool = False, max_grad_norm: float | None = None
) -> dict[str, Any]:
    """The unpipelined model trained with SGD (momentum) on the same batches, using its own
    loss (a token mean over the whole batch), its gradients clipped to ``max_grad_norm``
    when given; each step's loss and gradient norm, and the final state."""
    model = hf_model(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, norms = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        if padded:
            inputs, labels = padded_batch(step)
            loss = model(**inputs, labels=labels).loss
        else:
            loss = model(**batch(step)).loss
        loss.backward()
        if max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "state": model.state_dict()}


def train(
    name: str,
    configs: list[dict[str, Any]],
    padded: bool = False,
    evaluate: bool = False,
    save_to: str | None = None,
) -> list[dict[str, Any]]:
    """One capture of ``name``, then for each config a pipeline trained from the same
    initial weights, with the model's own loss (labels among the inputs) or, ``padded``,
    with :func:`pipetrain.causal_lm_loss` against the labels: its losses, this rank's state
    (parameters split over processes gathered whole), the names it holds of each shared
    parameter, how many parameter elements it holds, and with ``evaluate`` the logits
    ``eval_step`` gives for the first step's inputs after training (``save_to``: each
    pipeline saved there, in a directory named by its config's index)."""
    model = hf_model(name)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    sample = padded_batch(0)[0] if padded else batch(0)
    graph = GraphModel(model, {k: v[:2] for k, v in sample.items()})
    results = []
    for config in configs:
        model.load_state_dict(initial)
        pipe = make_pipeline(
            graph,
            optimizer=lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9),
            timeout_s=300,
            loss_fn=pipetrain.causal_lm_loss if padded else None,
            **{"microbatches": 2 * torch.distributed.get_world_size(), **config},
        )
        steps = [padded_batch(step) if padded else (batch(step),) for step in range(STEPS)]
        losses = [pipe.train_step(*data) for data in steps]
        state = {k: whole(v).detach().cpu().clone() for k, v in pipe.state_dict().items()}
        held = sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in pipe.parameters())
        results.append(
            {"losses": losses, "state": state, "shared": pipe.shared_parameters, "held": held}
        )
        if evaluate:
            results[-1]["evaluated"] = pipe.eval_step(steps[0][0]).logits.detach().clone()
        if save_to is not None:
            pipe.save(f"{save_to}/{len(results) - 1}")
    return results


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel parameter gathered whole (every mirror calls it), a tensor as is."""
    full = getattr(tensor, "full_tensor", None)
    return tensor if full is None else full()


class UNet(torch.nn.Module):
    """A small U-Net: each encoder's output skips to the decoder of its level."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.enc1 = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.enc2 = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU())
        self.mid = nn.Sequential(
            nn.MaxPool2d(2), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Upsample(scale_factor=2)
        )
        self.dec2 = nn.Sequential(
            nn.Conv2d(32, 8, 3, padding=1), nn.ReLU(), nn.Upsample(scale_factor=2)
        )
        self.dec1 = nn.Conv2d(16, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(e1)
        d2 = self.dec2(torch.cat([self.mid(e2), e2], 1))
        return self.dec1(torch.cat([d2, e1], 1))


def images(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, 3, 8, 8, generator=generator), torch.randn(
        BATCH, 3, 8, 8, generator=generator
    )


def unet_reference() -> dict[str, Any]:
    torch.manual_seed(0)
    model = UNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = images(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "state": model.state_dict()}


def train_captured(name: str, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Model ``name`` (``unet`` or ``resnet``) captured once and pipelined per config from
    the same initial weights and buffers: its losses, this rank's state and the names of
    the values crossing each cut."""
    build, data, loss_fn = CAPTURED[name]
    torch.manual_seed(0)
    model = build()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    graph = GraphModel(model, data(0)[0][:2])
    results = []
    for config in configs:
        model.load_state_dict(initial)
        pipe = make_pipeline(
            graph,
            loss_fn=loss_fn,
            microbatches=2 * torch.distributed.get_world_size(),
            optimizer=lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9),
            timeout_s=300,
            **config,
        )
        losses = [pipe.train_step(*data(step)) for step in range(STEPS)]
        state = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
        cuts = [sum(pipe.balance[:stage]) for stage in range(1, len(pipe.balance))]
        crossing = [graph.crossing(cut) for cut in cuts]
        results.append({"losses": losses, "state": state, "crossing": crossing})
    return results


def train_pipedream(name: str) -> dict[str, Any]:
    """The tied model on pipedream (one update per mini-batch, stashed weights): this rank's
    copy of each shared parameter before and after, and the losses."""
    model = hf_model(name)
    pipe = make_pipeline(
        model,
        example_inputs={k: v[:2] for k, v in batch(0).items()},
        schedule="pipedream",
        microbatches=4,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        timeout_s=300,
    )
    before = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
    losses = [pipe.train_step(batch(step)) for step in range(STEPS)]
    after = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
    shared = pipe.shared_parameters
    return {
        "losses": losses,
        "before": {k: before[k] for k in shared if k in before},
        "after": {k: after[k] for k in shared if k in after},
    }


class Block(torch.nn.Module):
    """A residual block with batch normalization."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn(self.conv(x)))


class ResNet(torch.nn.Module):
    """A small ResNet: a stem, four residual blocks with batch norm, a pooled head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = torch.nn.ModuleList(Block(8) for _ in range(4))
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


def labelled_images(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, 3, 8, 8, generator=generator), torch.randint(
        0, 4, (BATCH,), generator=generator
    )


def resnet_reference(microbatches: int) -> dict[str, Any]:
    """The unpipelined ResNet run micro-batch by micro-batch (batch statistics per
    micro-batch, each loss weighted by its share of the samples), then stepped."""
    torch.manual_seed(0)
    model = ResNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = labelled_images(step)
        total = 0.0
        for xs, ys in zip(x.tensor_split(microbatches), y.tensor_split(microbatches)):
            loss = torch.nn.functional.cross_entropy(model(xs), ys) * len(ys) / len(y)
            loss.backward()
            total += loss.item()
        optimizer.step()
        losses.append(total)
    return {"losses": losses, "state": model.state_dict()}


def save_tied(directory: str) -> dict[str, torch.Tensor]:
    """GPT-2 trained 2 steps with AdamW on 2 stages and saved; this rank's state."""
    model = hf_model("gpt2")
    pipe = make_pipeline(
        model,
        example_inputs={k: v[:2] for k, v in batch(0).items()},
        microbatches=2,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR),
        timeout_s=300,
    )
    for step in range(2):
        pipe.train_step(batch(step))
    pipe.save(directory)
    return {k: v.detach().clone() for k, v in pipe.state_dict().items()}


def train_meta(name: str, path: str) -> dict[str, Any]:
    """``name`` built on the meta device, each stage loaded from the weights file at
    ``path`` on its own rank, trained as :func:`reference`; this rank's losses and state."""
    with torch.device("meta"):
        model = hf_model(name)
    pipe = make_pipeline(
        model,
        example_inputs={k: v[:2] for k, v in batch(0).items()},
        microbatches=2 * torch.distributed.get_world_size(),
        optimizer=lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9),
        weights=path,
        timeout_s=300,
    )
    losses = [pipe.train_step(batch(step)) for step in range(STEPS)]
    return {
        "losses": losses,
        "state": {k: v.detach().clone() for k, v in pipe.state_dict().items()},
    }


def tied_sequential(seed: int = 0) -> torch.nn.Sequential:
    """A model given as layers whose output layer reuses the embedding's weight."""
    torch.manual_seed(seed)
    embedding = torch.nn.Embedding(VOCAB, 16)
    head = torch.nn.Linear(16, VOCAB, bias=False)
    head.weight = embedding.weight
    return torch.nn.Sequential(
        embedding, torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), head
    )


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def sequential_reference() -> dict[str, Any]:
    model = tied_sequential()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        ids = batch(step)["input_ids"]
        loss = lm_loss(model(ids), ids)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "state": model.state_dict()}


def train_sequential(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tied sequential model pipelined per config."""
    results = []
    for config in configs:
        pipe = make_pipeline(
            tied_sequential(),
            loss_fn=lm_loss,
            microbatches=2 * torch.distributed.get_world_size(),
            optimizer=lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9),
            timeout_s=300,
            **config,
        )
        ids = [batch(step)["input_ids"] for step in range(STEPS)]
        losses = [pipe.train_step(x, x) for x in ids]
        state = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
        results.append({"losses": losses, "state": state, "shared": pipe.shared_parameters})
    return results


CAPTURED: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[int], Any], Any]] = {
    "unet": (UNet, images, torch.nn.functional.mse_loss),
    "resnet": (ResNet, labelled_images, torch.nn.functional.cross_entropy),
}
