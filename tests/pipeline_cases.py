"""Models and worker functions for the multi-process pipeline tests (importable by spawned
workers)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from settings import make_pipeline
from torch import nn

import pipetrain
from pipetrain.model.layers import StageModule, to_layers
from pipetrain.runtime import PipelineConfig

FEATURES, CLASSES, BATCH = 6, 3, 10


def mlp(seed: int = 0, dropout: float = 0.0) -> nn.Sequential:
    """Five layers of uneven kinds, so any balance over 2–5 stages is possible."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(FEATURES, 12),
        nn.Tanh(),
        nn.Dropout(dropout),
        nn.Linear(12, 12),
        nn.Linear(12, CLASSES),
    )


def deep_mlp(seed: int = 0) -> nn.Sequential:
    """Nine layers, enough for two chunks on each of four ranks."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(FEATURES, 12),
        nn.Tanh(),
        nn.Linear(12, 12),
        nn.ReLU(),
        nn.Linear(12, 12),
        nn.Tanh(),
        nn.Linear(12, 12),
        nn.Linear(12, 12),
        nn.Linear(12, CLASSES),
    )


def model_and_data(
    config: dict,
) -> tuple[Callable[[], nn.Module], Callable[..., tuple[torch.Tensor, torch.Tensor]]]:
    """The model maker and data of a test config: ``tuple`` and ``deep`` pick the model."""
    if config.get("tuple"):
        return tuple_model, id_batch
    return (deep_mlp if config.get("deep") else mlp), batch


class Fork(nn.Module):
    """Returns a pair: a float activation and the integer ids it came from."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.embed(ids).mean(1), ids


class Mix(nn.Module):
    """Consumes the pair and passes both on, transformed."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, hidden: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.linear(hidden)), ids


class Join(nn.Module):
    """Uses the integer ids again after crossing stages."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, CLASSES)

    def forward(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden) + ids.float().mean(1, keepdim=True) * 0.01


def tuple_model(seed: int = 0) -> nn.Sequential:
    """Three layers whose boundaries carry (float, int64) tuples."""
    torch.manual_seed(seed)
    return nn.Sequential(Fork(), Mix(), Join())


def batch(seed: int = 1, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch of features and class labels."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, FEATURES, generator=generator), torch.randint(
        0, CLASSES, (size,), generator=generator
    )


def id_batch(seed: int = 1, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch of token ids and class labels."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 20, (size, 5), generator=generator), torch.randint(
        0, CLASSES, (size,), generator=generator
    )


def reference(
    make: Callable[[], nn.Module] = mlp,
    data: Callable[..., tuple[torch.Tensor, torch.Tensor]] = batch,
    size: int = BATCH,
) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of the whole model as one stage: the same tuple-unpacking rule,
    no pipeline."""
    model = StageModule(to_layers(make()))
    x, y = data(size=size)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss.item(), gradients(model.named_parameters())


def merged(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Every rank's gradients in one dict; no parameter may be on two ranks."""
    result: dict[str, torch.Tensor] = {}
    for grads in per_rank:
        assert not set(grads) & set(result), "two ranks own the same parameter"
        result.update(grads)
    return result


def gradients(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The gradients of the ``named`` tensors that have one, copied to the host."""
    found = {}
    for name, tensor in named:
        if tensor.grad is not None:
            found[name] = tensor.grad.cpu().clone()
    return found


def grads(pipe: pipetrain.Pipeline) -> dict[str, torch.Tensor]:
    """This rank's gradients by full-model name, on the host."""
    return gradients(pipe.named_parameters())


def run_configs(configs: list[dict]) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """Run one train step per config; return (loss, this rank's gradients) for each."""
    results = []
    for config in configs:
        make, data = model_and_data(config)
        config = {key: value for key, value in config.items() if key not in ("tuple", "deep")}
        size = config.pop("batch", BATCH)
        x, y = data(size=size)
        pipe = make_pipeline(make(), loss_fn=nn.functional.cross_entropy, **config)
        results.append((pipe.train_step(x, y), grads(pipe)))
    return results


def dropout_runs(modes: list[str]) -> list[dict[str, torch.Tensor]]:
    """Gradients of a dropout model under each recompute mode, from the same seed."""
    results = []
    for recompute in modes:
        pipe = make_pipeline(
            mlp(dropout=0.5),
            balance=[2, 3],
            microbatches=3,
            schedule="1f1b",
            loss_fn=nn.functional.cross_entropy,
            recompute=recompute,
        )
        torch.manual_seed(123)
        x, y = batch()
        pipe.train_step(x, y)
        results.append(grads(pipe))
    return results


def optimizer_and_shapes() -> dict:
    """Two SGD steps with batch sizes 10 then 7 (a change of shape), then eval and a timeline."""
    pipe = make_pipeline(
        mlp(),
        balance=[3, 2],
        microbatches=3,
        schedule="1f1b",
        loss_fn=nn.functional.cross_entropy,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
        record=True,
    )
    losses = [pipe.train_step(*batch(seed=1, size=10)), pipe.train_step(*batch(seed=2, size=7))]
    timeline = pipe.timeline()
    output = pipe.eval_step(batch(seed=3)[0])
    return {
        "losses": losses,
        "state": {k: v.clone() for k, v in pipe.state_dict().items()},
        "output": output,
        "timeline": timeline.to_dict() if timeline is not None else None,
    }


def argument_errors() -> list[str]:
    """Messages of the errors a user can cause when building or stepping a pipeline."""
    messages = []
    attempts = [
        lambda: make_pipeline(mlp(), balance=[2, 2], loss_fn=nn.functional.cross_entropy),
        lambda: make_pipeline(mlp(), balance=[2, 1, 2], loss_fn=nn.functional.cross_entropy),
        lambda: make_pipeline(
            mlp(), balance=[2, 3], loss_fn=nn.functional.cross_entropy, recompute="sometimes"
        ),
        lambda: make_pipeline(mlp(), balance=[2, 3], loss_fn=None),
        lambda: make_pipeline(
            mlp(), balance=[2, 3], microbatches=12, loss_fn=nn.functional.cross_entropy
        ).train_step(*batch()),
    ]
    for attempt in attempts:
        try:
            attempt()
            messages.append("no error")
        except (ValueError, TypeError) as error:
            messages.append(f"{type(error).__name__}: {error}")
    return messages


class Explode(nn.Module):
    """A layer that fails on its rank."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("bad shape on purpose")


class NotATensor(nn.Module):
    """A layer whose output cannot cross a stage boundary."""

    def forward(self, x: torch.Tensor) -> str:
        return "oops"


def failing_step(layer: str, ranks: int) -> None:
    """Train a model whose last layer (on the last rank) fails."""
    torch.manual_seed(0)
    broken = Explode() if layer == "explode" else NotATensor()
    layers = [nn.Linear(FEATURES, FEATURES) for _ in range(ranks - 1)] + [broken]
    pipe = make_pipeline(
        nn.Sequential(*layers),
        balance=[1] * ranks,
        microbatches=2,
        schedule="1f1b",
        loss_fn=nn.functional.cross_entropy,
        timeout_s=300,
    )
    pipe.train_step(*batch())


def failing_step_messages(ranks: int) -> str:
    """Like :func:`failing_step` but returns each rank's error message instead of raising."""
    try:
        failing_step("explode", ranks)
    except pipetrain.PipelineError as error:
        return str(error)
    return "no error"


def replicated_runs(
    configs: list[dict],
) -> list[tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    """One SGD step per config: (loss, gradients, weights after the step) on this rank."""
    results = []
    for config in configs:
        pipe = make_pipeline(
            mlp(),
            loss_fn=nn.functional.cross_entropy,
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
            **config,
        )
        loss = pipe.train_step(*batch())
        results.append((loss, grads(pipe), {k: v.clone() for k, v in pipe.state_dict().items()}))
    return results


def asynchronous_runs(
    schedule: str,
    balance: list[int],
    microbatches: int,
    windows: int,
    schedule_options: dict,
    settings: dict | None = None,
) -> dict[str, torch.Tensor]:
    """Train ``windows`` calls of an asynchronous schedule with SGD; return this rank's weights."""
    pipe = make_pipeline(
        mlp(),
        balance=balance,
        microbatches=microbatches,
        schedule=schedule,
        loss_fn=nn.functional.cross_entropy,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.2),
        schedule_options=schedule_options,
        **(settings or {}),
    )
    for window in range(windows):
        pipe.train_step(*batch(seed=10 + window, size=pipe.window * 2))
    return {k: v.clone() for k, v in pipe.state_dict().items()}


def targets_from_first_stage() -> list[float]:
    """Only rank 0 is given data; the last stage's rank gets its targets from it, then (a
    configuration given as one value) each of the last stage's two replicas does."""
    pipes = [
        make_pipeline(
            mlp(),
            balance=[1, 2, 2],
            microbatches=3,
            schedule="1f1b",
            loss_fn=nn.functional.cross_entropy,
            targets_on_first_stage=True,
        ),
        make_pipeline(
            mlp(),
            loss_fn=nn.functional.cross_entropy,
            config=PipelineConfig(
                "gpipe", 4, balance=[2, 3], replicas=[1, 2], targets_on_first_stage=True
            ),
        ),
    ]
    x, y = batch()
    return [pipe.train_step(x, y) if pipe.rank == 0 else pipe.train_step() for pipe in pipes]


def replicated_eval() -> torch.Tensor | None:
    """eval_step with the last stage on two replicas: the first gathers every micro-batch
    and sends them to every rank."""
    pipe = make_pipeline(
        mlp(),
        balance=[2, 3],
        replicas=[1, 2],
        microbatches=4,
        schedule="1f1b",
        loss_fn=nn.functional.cross_entropy,
    )
    return pipe.eval_step(batch(seed=3)[0])


def reducer_progress(bucket_bytes: float) -> list[int]:
    """Buckets started (and summed gradients) at each point of one update, on a 2-rank group.

    Parameters ``a`` (first) and ``b`` (last) each get a bucket of their own with
    ``bucket_bytes=1``; buckets go last parameter first, so ``b``'s must start before ``a``'s.
    """
    from pipetrain.runtime.rank.reduce import GradientReducer

    a, b = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    reducer = GradientReducer([a, b], dist.group.WORLD, 2, average=False, bucket_bytes=bucket_bytes)
    started = [reducer.started]
    reducer.arm([a, b])
    (a * (dist.get_rank() + 1)).sum().backward()  # a's gradient first: its bucket must wait for b's
    started.append(reducer.started)
    (b * 3).sum().backward()
    started.append(reducer.started)
    reducer.finish([a, b])
    got = gradients([("a", a), ("b", b)])
    return [*started, int(got["a"][0]), int(got["b"][0]), reducer.started]


def one_stage_on_the_default_device() -> tuple[float, str, dict[str, torch.Tensor]]:
    """One train step of the whole model as one stage, on the device the backend implies."""
    pipe = make_pipeline(
        mlp(), balance=[5], microbatches=2, schedule="1f1b", loss_fn=nn.functional.cross_entropy
    )
    loss = pipe.train_step(*batch())
    return loss, str(pipe.device), grads(pipe)
