"""Steps whose micro-batches differ in sequence length (documents of 8 to 1,024 tokens), on
the built-in GPT: the data, the unpipelined references (shared with the captured Llama's
cases) and the worker functions (importable by spawned workers)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch
from settings import make_pipeline
from torch import nn

import pipetrain
from pipetrain.app.models.gpt import build_gpt
from pipetrain.data.batches import microbatches
from pipetrain.runtime import MicroBatches

STEPS, MICROBATCHES, ROWS, SGD_LR = 2, 6, 2, 0.1
DOCUMENT_LENGTHS = [8, 30, 130, 520, 1024]  # tokens: short documents most, as corpora have
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
Batch = list[tuple[Any, torch.Tensor]]
Forward = Callable[[nn.Module, Any], Any]


def gpt() -> nn.Sequential:
    """Six layers: the embedding, four blocks, the head; context 1,024."""
    torch.manual_seed(0)
    return build_gpt(d_model=16, heads=2, n_layers=4, context=1024)


def documents(count: int, chance: random.Random, vocab: int = 256) -> list[list[int]]:
    """``count`` documents of 8 to 1,024 tokens (ids 1 to ``vocab - 1``), short ones most."""
    weights = [8, 6, 4, 2, 1]
    return [
        [chance.randrange(1, vocab) for _ in range(chance.choices(DOCUMENT_LENGTHS, weights)[0])]
        for _ in range(count)
    ]


def step_batches(seed: int = 0) -> list[Batch]:
    """Each step's micro-batches: documents of 8 to 1,024 bytes, padded per micro-batch,
    no two steps' longest alike."""
    chance = random.Random(seed)
    return [
        microbatches(documents(MICROBATCHES * ROWS, chance), count=MICROBATCHES)
        for _ in range(STEPS)
    ]


def called(model: nn.Module, inputs: Any) -> Any:
    """``model`` on one micro-batch's inputs (keywords when they are a dict)."""
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def unpipelined(
    model: nn.Module, steps: list[Batch], forward: Forward = called, loss_fn: Any = None
) -> dict[str, Any]:
    """``model`` trained with SGD on each step's micro-batches in one process: each step's
    loss is the token mean over all its micro-batches."""
    loss_fn = loss_fn or pipetrain.causal_lm_loss
    optimizer = sgd(model.parameters())
    losses = []
    for batch in steps:
        optimizer.zero_grad()
        pairs = [loss_fn(forward(model, x), y) for x, y in batch]
        loss = sum(t for t, _ in pairs) / sum(c for _, c in pairs)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "state": model.state_dict()}


def token_mean(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A micro-batch's own token mean: the scalar loss an asynchronous schedule takes."""
    total, count = pipetrain.causal_lm_loss(output, labels)
    return total / count


def sgd(params: Any) -> torch.optim.Optimizer:
    # not Adam: a key bias's gradient is zero up to rounding, which Adam would magnify
    return torch.optim.SGD(params, lr=SGD_LR, momentum=0.9)


def plain_sgd(params: Any) -> torch.optim.Optimizer:
    """SGD without momentum: the update PipeDream's replay applies."""
    return torch.optim.SGD(params, lr=SGD_LR)


def synchronous_reference() -> dict[str, Any]:
    """The unpipelined GPT on the same micro-batches."""
    return unpipelined(gpt(), step_batches())


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


def pipedream_replay(
    model: nn.Module,
    owner: dict[str, int],
    steps: list[Batch],
    forward: Forward = called,
    loss_fn: Any = None,
) -> dict[str, torch.Tensor]:
    """PipeDream's rule replayed in one process with SGD: micro-batch ``k`` of a call
    updates every stage, the stage ``owner[name]`` of each parameter computing on the
    version ``k - (p - s) + 1`` (the newest it holds; 0 at the call's start, as the
    pipeline drains between calls). The final parameters."""
    loss_fn = loss_fn or token_mean
    stages = max(owner.values()) + 1
    versions = [{n: p.detach().clone() for n, p in model.named_parameters()}]
    for batch in steps:
        base = len(versions) - 1
        for k, (x, y) in enumerate(batch):
            weights = {
                n: versions[base + max(0, k - (stages - owner[n]) + 1)][n].clone().requires_grad_()
                for n in owner
            }
            with torch.nn.utils.stateless._reparametrize_module(model, weights):
                loss = loss_fn(forward(model, x), y)
            grads = dict(zip(weights, torch.autograd.grad(loss, list(weights.values()))))
            versions.append({n: versions[-1][n] - SGD_LR * grads[n] for n in owner})
    return versions[-1]


def gpt_owner(model: nn.Sequential, balance: list[int]) -> dict[str, int]:
    """The stage of each of the GPT's parameters when ``balance`` cuts its layers."""
    owner = {}
    layer = 0
    for stage, count in enumerate(balance):
        for index in range(layer, layer + count):
            for name, _ in model[index].named_parameters():
                owner[f"{index}.{name}"] = stage
        layer += count
    return owner


def pipedream_reference(balance: list[int]) -> dict[str, torch.Tensor]:
    """The GPT's layers on the stages of ``balance`` under PipeDream's rule."""
    model = gpt()
    return pipedream_replay(model, gpt_owner(model, balance), step_batches())


def pipedream_run(balance: list[int]) -> dict[str, torch.Tensor]:
    """PipeDream with SGD over the same micro-batches; this rank's weights."""
    pipe = make_pipeline(
        gpt(),
        balance=balance,
        microbatches=MICROBATCHES,
        schedule="pipedream",
        loss_fn=token_mean,
        optimizer=plain_sgd,
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
    forms, each padded to its own longest."""
    from pipetrain.data.batches import padded

    batches = []
    for rows in steps:
        documents = [r.tolist() for r in rows]
        batches.append([padded([documents[i] for i in group]) for group in groups_of(rows)])
    return unpipelined(model, batches)


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


def packed_steps(seed: int = 3) -> list[Any]:
    """Each step's documents (8 to 1,024 bytes) packed into rows of at most 1,024 tokens,
    at least 4 rows: ``((tokens, documents), targets)``."""
    from pipetrain.app.corpus_stream import next_token_pair
    from pipetrain.data.batches import packed

    chance = random.Random(seed)
    return [
        packed([next_token_pair(d) for d in documents(16, chance)], 1024, rows=4)
        for _ in range(STEPS)
    ]


def layer_by_layer(model: nn.Module, inputs: Any) -> Any:
    """The GPT on packed rows: the document numbers go on beside the activations."""
    out = inputs
    for layer in model:
        out = layer(*out) if isinstance(out, tuple) else layer(out)
    return out


def packed_reference() -> dict[str, Any]:
    """The unpipelined GPT on the packed rows, one micro-batch for the whole step."""
    from pipetrain.app.models.gpt import gpt_token_loss

    steps = [[step] for step in packed_steps()]
    return unpipelined(gpt(), steps, layer_by_layer, gpt_token_loss)


def packed_token_mean(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A packed micro-batch's own token mean (targets already the next tokens)."""
    from pipetrain.app.models.gpt import gpt_token_loss

    total, count = gpt_token_loss(logits, targets)
    return total / count


def packed_pipedream_reference(balance: list[int]) -> dict[str, torch.Tensor]:
    """The GPT under PipeDream's rule on the packed rows, split as the pipeline splits
    them (``torch.tensor_split`` into 4 micro-batches)."""
    model = gpt()
    steps = []
    for (tokens, numbers), targets in packed_steps():
        pieces = zip(*(torch.tensor_split(t, 4) for t in (tokens, numbers, targets)))
        steps.append([((t, n), y) for t, n, y in pieces])
    owner = gpt_owner(model, balance)
    return pipedream_replay(model, owner, steps, layer_by_layer, packed_token_mean)


def packed_runs(schedules: list[str], balance: list[int] | None = None) -> list[dict[str, Any]]:
    """Each schedule on the packed rows (4 micro-batches): losses and this rank's weights
    (PipeDream with plain SGD and each micro-batch's own token mean)."""
    from pipetrain.app.models.gpt import gpt_token_loss

    results = []
    for schedule in schedules:
        pipedream = schedule == "pipedream"
        pipe = make_pipeline(
            gpt(),
            balance=balance,
            microbatches=4,
            schedule=schedule,
            loss_fn=packed_token_mean if pipedream else gpt_token_loss,
            optimizer=plain_sgd if pipedream else sgd,
        )
        losses = [pipe.train_step(inputs, targets) for inputs, targets in packed_steps()]
        state = {k: v.clone() for k, v in pipe.state_dict().items()}
        results.append({"schedule": schedule, "losses": losses, "state": state})
    return results
