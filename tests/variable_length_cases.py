"""Steps whose micro-batches differ in sequence length, on the built-in GPT: the data,
the unpipelined references and the worker functions (importable by spawned workers)."""

from __future__ import annotations

import random
from typing import Any

import torch
from settings import make_pipeline
from torch import nn

import pipetrain
from pipetrain.app.models.gpt import build_gpt
from pipetrain.data.batches import microbatches
from pipetrain.runtime import MicroBatches

STEPS, MICROBATCHES, ROWS, SGD_LR = 2, 6, 2, 0.1
SYNCHRONOUS = [
    "gpipe",
    "1f1b",
    "interleaved",
    "zb-h1",
    "looped-bfs",
    "interleaved-zb",
    "zb-v",
    "v-half",
    "v-min",
    "dualpipev",
]
Batch = list[tuple[torch.Tensor, torch.Tensor]]


def gpt() -> nn.Sequential:
    """Six layers: the embedding, four blocks, the head; context 64."""
    torch.manual_seed(0)
    return build_gpt(d_model=16, heads=2, n_layers=4, context=64)


def step_batches(seed: int = 0) -> list[Batch]:
    """Each step's micro-batches: documents of 3 to 64 bytes, padded per micro-batch."""
    chance = random.Random(seed)
    steps = []
    for _ in range(STEPS):
        documents = [
            [chance.randrange(256) for _ in range(chance.choice([3, 8, 17, 40, 64]))]
            for _ in range(MICROBATCHES * ROWS)
        ]
        steps.append(microbatches(documents, count=MICROBATCHES))
    return steps


def token_mean(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A micro-batch's own token mean: the scalar loss an asynchronous schedule takes."""
    total, count = pipetrain.causal_lm_loss(output, labels)
    return total / count


def sgd(params: Any) -> torch.optim.Optimizer:
    # not Adam: a key bias's gradient is zero up to rounding, which Adam would magnify
    return torch.optim.SGD(params, lr=SGD_LR, momentum=0.9)


def synchronous_reference() -> dict[str, Any]:
    """The unpipelined GPT: each step's loss is the token mean over all its micro-batches."""
    model = gpt()
    optimizer = sgd(model.parameters())
    losses = []
    for batch in step_batches():
        optimizer.zero_grad()
        pairs = [pipetrain.causal_lm_loss(model(x), y) for x, y in batch]
        loss = sum(t for t, _ in pairs) / sum(c for _, c in pairs)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "state": model.state_dict()}


def synchronous_runs(schedules: list[str], balance: list[int]) -> list[dict[str, Any]]:
    """Each schedule's losses and this rank's final weights, from the same start."""
    results = []
    for schedule in schedules:
        pipe = make_pipeline(
            gpt(),
            balance=balance,
            microbatches=MICROBATCHES,
            schedule=schedule,
            loss_fn=pipetrain.causal_lm_loss,
            optimizer=sgd,
        )
        losses = []
        for batch in step_batches():
            inputs = MicroBatches([x for x, _ in batch])
            targets = MicroBatches([y for _, y in batch])
            losses.append(pipe.train_step(inputs, targets))
        state = {k: v.clone() for k, v in pipe.state_dict().items()}
        results.append({"schedule": schedule, "losses": losses, "state": state})
    return results


def pipedream_reference(balance: list[int]) -> dict[str, torch.Tensor]:
    """PipeDream's rule replayed in one process with SGD: micro-batch ``k`` of a call
    updates every stage, stage ``s`` computing on the version ``k - (p - s) + 1`` (the
    newest it holds; 0 at the call's start, as the pipeline drains between calls)."""
    model = gpt()
    stages = len(balance)
    owner = {}
    layer = 0
    for stage, count in enumerate(balance):
        for index in range(layer, layer + count):
            for name, _ in model[index].named_parameters():
                owner[f"{index}.{name}"] = stage
        layer += count
    versions = [{n: p.detach().clone() for n, p in model.named_parameters()}]
    for batch in step_batches():
        base = len(versions) - 1
        for k, (x, y) in enumerate(batch):
            weights = {
                n: versions[base + max(0, k - (stages - owner[n]) + 1)][n].clone().requires_grad_()
                for n in owner
            }
            loss = token_mean(torch.func.functional_call(model, weights, (x,)), y)
            grads = dict(zip(weights, torch.autograd.grad(loss, list(weights.values()))))
            versions.append({n: versions[-1][n] - SGD_LR * grads[n] for n in owner})
    return versions[-1]


def pipedream_run(balance: list[int]) -> dict[str, torch.Tensor]:
    """PipeDream with SGD over the same micro-batches; this rank's weights."""
    pipe = make_pipeline(
        gpt(),
        balance=balance,
        microbatches=MICROBATCHES,
        schedule="pipedream",
        loss_fn=token_mean,
        optimizer=lambda params: torch.optim.SGD(params, lr=SGD_LR),
    )
    for batch in step_batches():
        pipe.train_step(MicroBatches([x for x, _ in batch]), MicroBatches([y for _, y in batch]))
    return {k: v.clone() for k, v in pipe.state_dict().items()}


BUDGET, BUDGET_STEPS = 96, 3
LENGTHS = [[3, 5, 9], [5, 9, 20, 33], [9, 20, 33, 64]]  # each step's, longer and longer


def budget_rows(seed: int = 1) -> list[list[torch.Tensor]]:
    """Each step's rows: 8 documents of 3 to 64 bytes, skewed differently each step."""
    chance = random.Random(seed)
    return [
        [torch.randint(0, 256, (chance.choice(LENGTHS[step]),)) for _ in range(8)]
        for step in range(BUDGET_STEPS)
    ]


def budget_groups(rows: list[torch.Tensor], multiple: int) -> list[list[int]]:
    """The micro-batches a token budget forms, split to a multiple of ``multiple``."""
    from pipetrain.data.batches import token_budget_groups
    from pipetrain.runtime.token_budget import split_to

    groups = token_budget_groups([len(r) for r in rows], BUDGET)
    return split_to(groups, -(-len(groups) // multiple) * multiple)


def grouped_reference(
    model: nn.Module, steps: list[list[torch.Tensor]], groups_of: Any
) -> dict[str, Any]:
    """``model`` unpipelined on each step's rows in the micro-batches ``groups_of(rows)``
    forms, each padded to its own longest: each step's loss is the token mean over all."""
    from pipetrain.data.batches import padded

    optimizer = sgd(model.parameters())
    losses = []
    for rows in steps:
        optimizer.zero_grad()
        documents = [r.tolist() for r in rows]
        pairs = []
        for group in groups_of(rows):
            x, y = padded([documents[i] for i in group])
            pairs.append(pipetrain.causal_lm_loss(model(x), y))
        loss = sum(t for t, _ in pairs) / sum(c for _, c in pairs)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "state": model.state_dict()}


def budget_reference(multiple: int) -> dict[str, Any]:
    """The unpipelined GPT on the micro-batches a token budget forms."""
    return grouped_reference(gpt(), budget_rows(), lambda rows: budget_groups(rows, multiple))


def budget_runs(schedules: list[str]) -> list[dict[str, Any]]:
    """Each schedule with ``microbatch_tokens``: its losses and this rank's weights."""
    from pipetrain.runtime import PipelineConfig, Sequences

    results = []
    for schedule in schedules:
        config = PipelineConfig(schedule, 2, microbatch_tokens=BUDGET)
        pipe = make_pipeline(gpt(), loss_fn=pipetrain.causal_lm_loss, optimizer=sgd, config=config)
        losses = [pipe.train_step(Sequences(rows), Sequences(rows)) for rows in budget_rows()]
        state = {k: v.clone() for k, v in pipe.state_dict().items()}
        results.append({"schedule": schedule, "losses": losses, "state": state})
    return results


LLAMA_MICROBATCHES, LLAMA_BUDGET = 4, 120


def llama_steps(seed: int = 2) -> list[list[torch.Tensor]]:
    """Each step's rows for the captured Llama: 8 documents of 3 to 40 tokens (ids 1-63)."""
    chance = random.Random(seed)
    return [
        [
            torch.tensor([chance.randrange(1, 64) for _ in range(chance.choice([3, 7, 16, 40]))])
            for _ in range(8)
        ]
        for _ in range(STEPS)
    ]


def llama_groups(rows: list[torch.Tensor], budget: int | None) -> list[list[int]]:
    """The micro-batches of a step: a fixed count of consecutive rows, or a token budget."""
    from pipetrain.data.batches import fixed_groups, token_budget_groups

    if budget is None:
        return fixed_groups(len(rows), LLAMA_MICROBATCHES)
    return token_budget_groups([len(r) for r in rows], budget)


def llama_reference(budget: int | None) -> dict[str, Any]:
    """The unpipelined Llama on the same micro-batches."""
    from graph_cases import hf_model

    return grouped_reference(
        hf_model("llama"), llama_steps(), lambda rows: llama_groups(rows, budget)
    )


def llama_runs(schedules: list[str], budget: int | None) -> list[dict[str, Any]]:
    """One capture of the stock Llama (tied embeddings) on 2 x 8 tokens, then each
    schedule on rows of every length from the same initial weights: by a fixed count of
    micro-batches, or by a token budget. Its losses and this rank's weights."""
    from graph_cases import hf_model

    from pipetrain.model.graph import GraphModel
    from pipetrain.runtime import PipelineConfig, Sequences

    model = hf_model("llama")
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    graph = GraphModel(model, torch.randint(1, 64, (2, 8)))
    results = []
    for schedule in schedules:
        model.load_state_dict(initial)
        config = PipelineConfig(schedule, LLAMA_MICROBATCHES, microbatch_tokens=budget)
        pipe = make_pipeline(graph, loss_fn=pipetrain.causal_lm_loss, optimizer=sgd, config=config)
        losses = [pipe.train_step(Sequences(rows), Sequences(rows)) for rows in llama_steps()]
        state = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
        results.append({"schedule": schedule, "losses": losses, "state": state})
    return results


def packed_steps(seed: int = 3) -> list[Any]:
    """Each step's documents (3 to 60 bytes) packed into rows of at most 64 tokens, at
    least 4 rows: ``((tokens, documents), targets)``."""
    from pipetrain.app.corpus_stream import next_token_pair
    from pipetrain.data.batches import packed

    chance = random.Random(seed)
    steps = []
    for _ in range(STEPS):
        documents = [
            [chance.randrange(256) for _ in range(chance.choice([3, 9, 20, 41, 60]))]
            for _ in range(12)
        ]
        steps.append(packed([next_token_pair(d) for d in documents], 64, rows=4))
    return steps


def packed_reference() -> dict[str, Any]:
    """The unpipelined GPT on the packed rows, layer by layer (document numbers beside the
    activations): each step's loss is the token mean over every row."""
    from pipetrain.app.models.gpt import gpt_token_loss

    model = gpt()
    optimizer = sgd(model.parameters())
    losses = []
    for (tokens, documents), targets in packed_steps():
        optimizer.zero_grad()
        out: Any = (tokens, documents)
        for layer in model:
            out = layer(*out) if isinstance(out, tuple) else layer(out)
        total, count = gpt_token_loss(out, targets)
        loss = total / count
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "state": model.state_dict()}


def packed_runs(schedules: list[str]) -> list[dict[str, Any]]:
    """Each schedule on the packed rows (4 micro-batches): losses and this rank's weights."""
    from pipetrain.app.models.gpt import gpt_token_loss

    results = []
    for schedule in schedules:
        pipe = make_pipeline(
            gpt(), microbatches=4, schedule=schedule, loss_fn=gpt_token_loss, optimizer=sgd
        )
        losses = [pipe.train_step(inputs, targets) for inputs, targets in packed_steps()]
        state = {k: v.clone() for k, v in pipe.state_dict().items()}
        results.append({"schedule": schedule, "losses": losses, "state": state})
    return results
