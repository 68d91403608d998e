"""A captured stock Hugging Face Llama on documents of 8 to 1,024 tokens: padded per
micro-batch, by a token budget, or packed several to a row with ``position_ids`` that
restart at each document. The data, references and worker functions (importable by
spawned workers); the references are the unpipelined model in one process."""

from __future__ import annotations

import random
from typing import Any

import torch
from graph_cases import hf_model
from settings import make_pipeline
from variable_length_cases import (
    STEPS,
    called,
    documents,
    grouped_reference,
    pipedream_replay,
    plain_sgd,
    sgd,
    token_mean,
    unpipelined,
)

import pipetrain

MICROBATCHES, BUDGET, CONTEXT = 4, 1100, 1024


def llama(name: str = "llama") -> torch.nn.Module:
    """The small Llama of the graph cases (tied, or ``llama-untied``), positions to 1,024."""
    return hf_model(name, context=CONTEXT)


def llama_steps(seed: int = 2) -> list[list[torch.Tensor]]:
    """Each step's rows: 8 documents of 8 to 1,024 tokens (ids 1-63)."""
    chance = random.Random(seed)
    return [[torch.tensor(d) for d in documents(8, chance, vocab=64)] for _ in range(STEPS)]


def llama_groups(rows: list[torch.Tensor], budget: int | None) -> list[list[int]]:
    """The micro-batches of a step: a fixed count of consecutive rows, or a token budget."""
    from pipetrain.data.batches import fixed_groups, token_budget_groups

    if budget is None:
        return fixed_groups(len(rows), MICROBATCHES)
    return token_budget_groups([len(r) for r in rows], budget)


def llama_reference(budget: int | None) -> dict[str, Any]:
    """The unpipelined Llama on the same micro-batches."""
    return grouped_reference(llama(), llama_steps(), lambda rows: llama_groups(rows, budget))


def captured(model: torch.nn.Module, positions: bool = False) -> Any:
    """One capture of ``model`` on 2 x 8 tokens (with ``position_ids`` for packed rows)."""
    from pipetrain.model.graph import GraphModel

    ids = torch.randint(1, 64, (2, 8))
    if not positions:
        return GraphModel(model, ids)
    return GraphModel(model, {"input_ids": ids, "position_ids": torch.arange(8).repeat(2, 1)})


def llama_runs(
    schedules: list[str], budget: int | None, name: str = "llama"
) -> list[dict[str, Any]]:
    """One capture of the stock Llama, then each schedule on rows of every length from
    the same initial weights: by a fixed count of micro-batches, or by a token budget
    (PipeDream with plain SGD and each micro-batch's own token mean). Its losses and this
    rank's weights."""
    from pipetrain.runtime import PipelineConfig, Sequences

    model = llama(name)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    graph = captured(model)
    results = []
    for schedule in schedules:
        model.load_state_dict(initial)
        pipedream = schedule == "pipedream"
        config = PipelineConfig(schedule, MICROBATCHES, microbatch_tokens=budget)
        pipe = make_pipeline(
            graph,
            loss_fn=token_mean if pipedream else pipetrain.causal_lm_loss,
            optimizer=plain_sgd if pipedream else sgd,
            config=config,
        )
        losses = [pipe.train_step(Sequences(rows), Sequences(rows)) for rows in llama_steps()]
        state = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
        results.append({"schedule": schedule, "losses": losses, "state": state})
    return results


def pipedream_reference(owner: dict[str, int], packed: bool) -> dict[str, torch.Tensor]:
    """The untied Llama under PipeDream's rule, each parameter on the stage ``owner``
    names: on the fixed micro-batches padded each to its longest, or on the packed rows
    split as the pipeline splits them (``torch.tensor_split`` into 4)."""
    from pipetrain.data.batches import padded

    steps = []
    if packed:
        for inputs, labels in packed_steps():
            ids, positions, targets = (
                torch.tensor_split(t, MICROBATCHES)
                for t in (inputs["input_ids"], inputs["position_ids"], labels)
            )
            steps.append(
                [
                    ({"input_ids": a, "position_ids": b}, y)
                    for a, b, y in zip(ids, positions, targets)
                ]
            )
    else:
        for rows in llama_steps():
            ids = [r.tolist() for r in rows]
            steps.append([padded([ids[i] for i in g]) for g in llama_groups(rows, None)])
    forward = without_cache if packed else called
    return pipedream_replay(llama("llama-untied"), owner, steps, forward)


def packed_steps(seed: int = 4) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """Each step's 12 documents packed into rows of at most 1,024 tokens, at least 4."""
    from pipetrain.data.batches import packed_positions

    chance = random.Random(seed)
    return [
        packed_positions(documents(12, chance, vocab=64), CONTEXT, rows=MICROBATCHES)
        for _ in range(STEPS)
    ]


def without_cache(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> Any:
    """The Llama on packed rows: transformers reads ``position_ids`` as document bounds
    only without a key-value cache (the capture runs without one too)."""
    return model(**inputs, use_cache=False)


def packed_reference() -> dict[str, Any]:
    """The unpipelined Llama on the packed rows, the whole step at once."""
    return unpipelined(llama(), [[step] for step in packed_steps()], without_cache)


def packed_runs(schedules: list[str], name: str = "llama") -> list[dict[str, Any]]:
    """One capture with ``position_ids``, then each schedule on the packed rows (4
    micro-batches; PipeDream as in :func:`llama_runs`): losses and this rank's weights."""
    model = llama(name)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    graph = captured(model, positions=True)
    results = []
    for schedule in schedules:
        model.load_state_dict(initial)
        pipedream = schedule == "pipedream"
        pipe = make_pipeline(
            graph,
            microbatches=MICROBATCHES,
            schedule=schedule,
            loss_fn=token_mean if pipedream else pipetrain.causal_lm_loss,
            optimizer=plain_sgd if pipedream else sgd,
        )
        losses = [pipe.train_step(inputs, labels) for inputs, labels in packed_steps()]
        state = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
        results.append({"schedule": schedule, "losses": losses, "state": state})
    return results
