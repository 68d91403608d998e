"""Worker functions for the tensor-parallel tests (importable by spawned workers), and the
unpipelined loops they are compared with."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import precision_cases
import torch
import training_cases as cases
from pipeline_cases import CLASSES, FEATURES
from settings import make_pipeline
from torch import nn
from torch.distributed.tensor import DTensor

from pipetrain.app.models.gpt import build_gpt, gpt_loss

# the MLP given as layers: two (colwise, rowwise) pairs, one per stage of balance [3, 3]
MLP_PLAN = {"0": "colwise", "2": "rowwise", "3": "colwise", "5": "rowwise"}
GPT = {"d_model": 16, "heads": 4, "n_layers": 2, "context": 8, "vocab": 32}


def tp_mlp(seed: int = 3) -> nn.Sequential:
    """Six layers: Linear, Tanh, Linear, Linear, Tanh, Linear."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(FEATURES, 8),
        nn.Tanh(),
        nn.Linear(8, 12),
        nn.Linear(12, 8),
        nn.Tanh(),
        nn.Linear(8, CLASSES),
    )


def gpt(seed: int = 4) -> nn.Sequential:
    torch.manual_seed(seed)
    return build_gpt(**GPT)


def gpt_calls() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token batches (8 rows of 8 tokens) and their next tokens, one per call."""
    generator = torch.Generator().manual_seed(7)
    calls = []
    for _ in range(cases.UPDATES * cases.ACCUMULATE):
        tokens = torch.randint(0, GPT["vocab"], (8, GPT["context"] + 1), generator=generator)
        calls.append((tokens[:, :-1], tokens[:, 1:]))
    return calls


MODELS: dict[str, tuple[Callable[[], nn.Module], Any, Callable[[], list[Any]]]] = {
    "mlp": (tp_mlp, nn.functional.cross_entropy, cases.calls),
    "gpt": (gpt, gpt_loss, gpt_calls),
}


def reference(model_name: str) -> dict[str, Any]:
    """The unpipelined loop: accumulate two calls, clip, step AdamW and the schedule."""
    build, loss_fn, calls = MODELS[model_name]
    model = build()
    optimizer = cases.adamw(model.parameters())
    schedule = cases.scheduler(optimizer)
    losses, norms = [], []
    data = calls()
    for update in range(cases.UPDATES):
        optimizer.zero_grad()
        for x, y in data[update * cases.ACCUMULATE : (update + 1) * cases.ACCUMULATE]:
            loss = loss_fn(model(x), y)
            loss.backward()
            losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cases.MAX_NORM)))
        optimizer.step()
        schedule.step()
    # the gradient norm of the first call's batch on the final weights
    optimizer.zero_grad()
    loss_fn(model(data[0][0]), data[0][1]).backward()
    final = float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf))
    return {"losses": losses, "norms": norms, "state": model.state_dict(), "final_norm": final}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter whole: a split one gathered from its shards (every mirror calls it)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def tensor_parallel_loop(
    model_name: str, schedule: str, keep: bool = False, **settings: Any
) -> dict[str, Any]:
    """The reference loop on a pipeline of tensor-parallel stages: every call's loss, the
    whole weights this process's stage ends with, whom it sent messages itself, and how
    many of its stage's parameters it holds (with ``keep``, the pipeline too)."""
    build, loss_fn, calls = MODELS[model_name]
    config: dict[str, Any] = {"balance": [3, 3]} if model_name == "mlp" else {"balance": [2, 2]}
    if model_name == "mlp":
        config["tensor_parallel_plan"] = MLP_PLAN
    pipe = make_pipeline(
        build(),
        loss_fn=loss_fn,
        optimizer=cases.adamw,
        lr_scheduler=cases.scheduler,
        max_grad_norm=cases.MAX_NORM,
        schedule=schedule,
        microbatches=4,
        tensor_parallel=2,
        **{**config, **settings},
    )
    world = pipe.transport.world  # type: ignore[attr-defined]
    sent = []
    send = world.send
    world.send = lambda tensors, peer, channel: (sent.append(peer), send(tensors, peer, channel))
    losses = []
    for k, (x, y) in enumerate(calls()):
        update = k % cases.ACCUMULATE == cases.ACCUMULATE - 1
        losses.append(pipe.train_step(x, y, update=update))
    final_norm = None
    # the global norm of the first call's gradients on the final weights (without replicas:
    # theirs wait unreduced for an update)
    if not keep and settings.get("data_parallel", 1) == 1:
        pipe.train_step(*calls()[0], update=False)
        final_norm = pipe.clip_grad_norm_(math.inf)
    held = sum(
        p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in pipe.parameters()
    )
    return {
        "losses": losses,
        "state": {name: _full(t).clone() for name, t in pipe.state_dict().items()},
        "updates": pipe.updates,
        "final_norm": final_norm,
        "sent_to": sorted(set(sent)),
        "held": held,
        "whole": sum(p.numel() for p in pipe.parameters()),
        **({"pipe": pipe} if keep else {}),
    }


def refusals() -> list[str]:
    """What tensor parallelism refuses, with the reason: one message per setting."""
    attempts: list[tuple[Callable[[], nn.Module], dict[str, Any]]] = [
        (tp_mlp, {"balance": [3, 3]}),  # no plan
        (tp_mlp, {"balance": [2, 4], "tensor_parallel_plan": MLP_PLAN}),  # a pair cut apart
        (tp_mlp, {"balance": [3, 3], "tensor_parallel_plan": {"0": "colwise", "9": "rowwise"}}),
        (tp_mlp, {"balance": [3, 3], "tensor_parallel_plan": {"1": "colwise"}}),  # a Tanh
        (tp_mlp, {"balance": [3, 3], "tensor_parallel_plan": {"0": "sideways"}}),
        (tp_mlp, {"balance": [3, 3], "tensor_parallel": 3}),  # 4 processes
        (lambda: build_gpt(d_model=18, heads=3, n_layers=2), {"balance": [2, 2]}),  # 3 heads
        (tp_mlp, {"balance": [3, 3], "schedule": "pipedream", "tensor_parallel_plan": MLP_PLAN}),
    ]
    messages = []
    for build, settings in attempts:
        try:
            make_pipeline(
                build(),
                loss_fn=nn.functional.cross_entropy,
                optimizer=cases.adamw,
                microbatches=4,
                **{"tensor_parallel": 2, **settings},
            )
            messages.append("accepted")
        except ValueError as error:
            messages.append(str(error))
    return messages


def data_parallel_loop(model_name: str, schedule: str, shard: bool) -> dict[str, Any]:
    """:func:`tensor_parallel_loop` with two replicas of every stage (``shard``: each
    holding a shard of what tensor parallelism leaves it)."""
    return tensor_parallel_loop(model_name, schedule, data_parallel=2, shard=shard)


def recomputed_evaluated_and_saved(root: str) -> dict[str, Any]:
    """The MLP's reference loop on 2 stages x 2 mirrors recomputing every forward, then an
    evaluation of the first call's inputs on every process, saved under ``root``."""
    result = tensor_parallel_loop("mlp", "gpipe", recompute="always", keep=True)
    pipe = result.pop("pipe")
    result["evaluated"] = pipe.eval_step(cases.calls()[0][0])
    result["saved"] = str(pipe.save(root))
    return result


def loaded_without_tensor_parallel(path: str) -> dict[str, Any]:
    """A tensor-parallel checkpoint loaded by 2 stages of one process each: the weights this
    process's stage holds, and the update count found."""
    pipe = make_pipeline(
        tp_mlp(seed=11), loss_fn=nn.functional.cross_entropy, optimizer=cases.adamw, balance=[3, 3]
    )
    found = pipe.load(path)
    return {"state": {k: v.clone() for k, v in pipe.state_dict().items()}, "updates": found.updates}


def fp16_loop() -> dict[str, Any]:
    """The mixed-precision tests' fp16 loop (a loss scale that overflows, backs off and
    grows) with the first stage split over 2 mirrors (the test MLP: its first Linear
    colwise, its third rowwise)."""
    results = precision_cases.pipelined_loop(
        [
            {
                "precision": "fp16",
                "balance": [4, 1],
                "microbatches": 4,
                "tensor_parallel": 2,
                "tensor_parallel_plan": {"0": "colwise", "3": "rowwise"},
            }
        ]
    )
    return {**results[0], "state": {k: _full(v).clone() for k, v in results[0]["state"].items()}}


def chunked_loop(schedule: str, options: dict[str, Any]) -> dict[str, Any]:
    """:func:`tensor_parallel_loop` of the GPT's 4 layers as 4 stages, two on each rank."""
    return tensor_parallel_loop("gpt", schedule, balance=[1, 1, 1, 1], schedule_options=options)


def mirrored_messages() -> list[Any]:
    """Two schedule ranks of 2 processes each: rank 0 sends rank 1 three messages of mixed
    dtypes on one channel (the shapes change in the third) and one back; what every process
    received, and whom each sent to itself."""
    import torch.distributed as dist

    from pipetrain.distributed.mirrored import MirroredTransport
    from pipetrain.distributed.torch_transport import TorchTransport
    from pipetrain.runtime.rank.tensor_parallel import mirror_groups

    messages, _ = mirror_groups(2, None)
    transport = MirroredTransport(TorchTransport(torch.device("cpu"), timeout_s=60), 2, messages)
    rank = dist.get_rank() // 2
    sent = []
    send = transport.world.send
    transport.world.send = lambda tensors, peer, channel: (  # type: ignore[method-assign]
        sent.append(peer),
        send(tensors, peer, channel),
    )
    received: list[Any] = []
    if rank == 0:
        for rows in (2, 2, 3):
            tensors = (
                torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3).requires_grad_(),
                torch.arange(rows, dtype=torch.int64) * 7,
                torch.tensor([True, False] * rows),
                torch.full((rows,), 0.5, dtype=torch.float16),
            )
            transport.send(tensors, 1, ("F", 0))
        received.append(transport.receive(1, ("B", 0)))
    else:
        received = [transport.receive(0, ("F", 0)) for _ in range(3)]
        transport.send((torch.ones(4) * dist.get_rank(),), 0, ("B", 0))
    transport.flush()
    return [[tuple(t.detach().clone() for t in message) for message in received], sent]
