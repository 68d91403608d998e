"""Statistical efficiency of the schedules: held-out metric per epoch, pipelined vs unpipelined.

Trains the built-in CNN on scikit-learn's digits and the byte GPT on the standard library's
source with the same per-update batch, optimizer (Adam; learning rate warmed up linearly,
then cosine-decayed),
initial weights and data order: unpipelined (plain PyTorch, one process, one thread), and
with pipetrain's 1f1b, pipedream and 2bw schedules on 2 worker processes (1 thread each, one
stage each). A second
unpipelined run from other initial weights shows how far two equally good runs drift apart.
After every epoch it evaluates on held-out data (digits: test accuracy and loss; GPT: loss on
the held-out windows, an "epoch" being a fixed number of training samples). Writes a PNG of
the curves and prints the final metrics beside the unpipelined run's.

    python benchmarks/bench_convergence.py [--quick] [--plot PATH] [--gpt-lr 3e-3] \
        [--gpt-epochs 28] [--warmup 0.1]
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import pipetrain
from pipetrain.app.data import BatchStream
from pipetrain.app.models import build_model, loss_function

STAGES = 2
SCHEDULES = ("1f1b", "pipedream", "2bw")
UNPIPELINED = "unpipelined"
OTHER_INIT = "unpipelined, other init"
ACCURACY_TARGET_PP = 1.0  # allowed absolute accuracy gap, percentage points
LOSS_TARGET_PCT = 2.0  # allowed relative loss gap, percent

Metrics = dict[str, float]


@dataclass(frozen=True)
class Setup:
    """One model's training run, shared by every schedule."""

    model: str
    batch_size: int  # samples per optimizer update, in every run
    lr: float  # peak learning rate, reached after the warm-up, then cosine-decayed towards 0
    warmup: float  # share of the updates over which the learning rate rises linearly to its peak
    epochs: int
    updates_per_epoch: int
    microbatches: int  # micro-batches per update for 1f1b and 2bw
    window: (
        int  # updates per train_step call for pipedream and 2bw; the pipeline drains between calls
    )

    def __post_init__(self) -> None:
        """Whole calls per epoch, so every run evaluates after the same samples."""
        if self.updates_per_epoch % self.window:
            raise ValueError(
                f"updates_per_epoch {self.updates_per_epoch} must be a multiple of "
                f"window {self.window}"
            )

    @property
    def samples_per_epoch(self) -> int:
        """Training samples between two evaluations."""
        return self.updates_per_epoch * self.batch_size

    def learning_rate(self, updates_done: int) -> float:
        """Linear warm-up, then cosine decay, held constant over each window: the asynchronous
        schedules can change the learning rate only between calls, so every run changes it
        at the same points."""
        windows = self.epochs * self.updates_per_epoch // self.window
        warm = round(self.warmup * windows)
        window = updates_done // self.window
        if window < warm:
            return self.lr * (window + 1) / warm
        return self.lr * 0.5 * (1 + math.cos(math.pi * (window - warm) / (windows - warm)))


def setups(
    quick: bool, gpt_lr: float = 3e-3, gpt_epochs: int = 28, warmup: float = 0.1
) -> list[Setup]:
    """The CNN and GPT runs; ``quick`` shortens both to a smoke test."""
    digits_epoch = BatchStream(
        "cnn", 32
    ).epoch_size  # 44 updates of 32: one pass over the 1437 training digits
    if quick:
        return [
            Setup("cnn", 32, 1e-3, warmup, 2, digits_epoch, 4, 11),
            Setup("gpt", 32, gpt_lr, warmup, 2, 22, 4, 11),
        ]
    return [
        Setup("cnn", 32, 1e-3, warmup, 15, digits_epoch, 4, 11),
        Setup("gpt", 32, gpt_lr, warmup, gpt_epochs, 132, 4, 11),
    ]


def held_out(model_name: str, outputs: torch.Tensor, targets: torch.Tensor) -> Metrics:
    """Held-out loss, plus accuracy (%) for the digits classifier."""
    metrics = {"loss": float(loss_function(model_name)(outputs, targets))}
    if model_name == "cnn":
        metrics["accuracy"] = 100.0 * float((outputs.argmax(dim=1) == targets).float().mean())
    return metrics


def train(
    setup: Setup,
    updates_per_call: int,
    train_step: Callable[[torch.Tensor, torch.Tensor], float],
    predict: Callable[[torch.Tensor], torch.Tensor | None],
    optimizer: torch.optim.Optimizer,
) -> list[Metrics] | None:
    """Train for ``setup.epochs`` epochs, ``updates_per_call`` updates per ``train_step``; held-out
    metrics before training and after each epoch (``None`` where ``predict`` gives no output)."""
    stream = BatchStream(setup.model, setup.batch_size, seed=0)
    eval_inputs, eval_targets = stream.eval_set()
    history: list[Metrics] = []

    def evaluate() -> None:
        outputs = predict(eval_inputs)
        if outputs is not None:
            history.append(held_out(setup.model, outputs, eval_targets))

    evaluate()
    updates_done = 0
    for _ in range(setup.epochs):
        for _ in range(setup.updates_per_epoch // updates_per_call):
            for group in optimizer.param_groups:
                group["lr"] = setup.learning_rate(updates_done)
            batches = [next(stream) for _ in range(updates_per_call)]
            train_step(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))
            updates_done += updates_per_call
        evaluate()
    return history or None


def adam(lr: float) -> Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]:
    """An optimizer factory: Adam over the given parameters, no learning-rate rescaling."""
    return lambda parameters: torch.optim.Adam(parameters, lr=lr)


def run_unpipelined(setup: Setup, init_seed: int) -> list[Metrics]:
    """The whole model in this process, one thread, one update per batch."""
    torch.set_num_threads(1)
    model = build_model(setup.model, seed=init_seed)
    loss_fn = loss_function(setup.model)
    optimizer = adam(setup.lr)(model.parameters())

    def train_step(inputs: torch.Tensor, targets: torch.Tensor) -> float:
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    def predict(inputs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(inputs)

    return train(setup, 1, train_step, predict, optimizer)


def run_pipelined(setup: Setup, schedule: str) -> list[Metrics] | None:
    """Worker: train with ``schedule``; the last stage's rank returns the history."""
    options = {
        "1f1b": {"microbatches": setup.microbatches},
        "pipedream": {"microbatches": setup.window},  # one mini-batch, one update
        "2bw": {"microbatches": setup.microbatches, "schedule_options": {"rounds": setup.window}},
    }[schedule]
    model = build_model(setup.model, seed=0)
    pipe = pipetrain.Pipeline(
        model,
        loss_fn=loss_function(setup.model),
        optimizer=adam(setup.lr),
        config=pipetrain.PipelineConfig(schedule=schedule, **options),
    )
    updates_per_call = 1 if schedule == "1f1b" else setup.window
    return train(setup, updates_per_call, pipe.train_step, pipe.eval_step, pipe.optimizer)


def run_all(setup: Setup) -> dict[str, list[Metrics]]:
    """Every run of one model, keyed by label."""
    runs: dict[str, Callable[[], list[Metrics]]] = {
        UNPIPELINED: lambda: run_unpipelined(setup, init_seed=0),
        OTHER_INIT: lambda: run_unpipelined(setup, init_seed=1),
    }
    for schedule in SCHEDULES:
        runs[schedule] = lambda schedule=schedule: _last_rank(
            pipetrain.launch(run_pipelined, STAGES, setup, schedule, threads_per_worker=1)
        )
    histories: dict[str, list[Metrics]] = {}
    for label, run in runs.items():
        began = time.perf_counter()
        histories[label] = run()
        print(f"  {setup.model} {label}: {time.perf_counter() - began:.0f} s", flush=True)
    return histories


def _last_rank(results: list[list[Metrics] | None]) -> list[Metrics]:
    history = results[-1]
    if history is None:
        raise RuntimeError("the last stage's rank returned no held-out metrics")
    return history


def table(setup: Setup, histories: dict[str, list[Metrics]]) -> list[str]:
    """Markdown rows: final metrics of each run and their gap to the unpipelined run; the
    target is judged on accuracy for the CNN, on held-out loss for the GPT."""
    base = histories[UNPIPELINED][-1]
    rows = []
    for label, history in histories.items():
        final = history[-1]
        loss_gap = 100.0 * (final["loss"] - base["loss"]) / base["loss"]
        if setup.model == "cnn":
            accuracy_gap = final["accuracy"] - base["accuracy"]
            met = accuracy_gap >= -ACCURACY_TARGET_PP
            cells = [
                f"{final['accuracy']:.2f}%",
                f"{accuracy_gap:+.2f} pp",
                f"{final['loss']:.4f}",
                f"{loss_gap:+.1f}%",
            ]
        else:
            met = loss_gap <= LOSS_TARGET_PCT
            cells = ["", "", f"{final['loss']:.4f}", f"{loss_gap:+.2f}%"]
        verdict = "—" if label == UNPIPELINED else ("yes" if met else "no")
        rows.append(f"| {setup.model} | {label} | " + " | ".join(cells) + f" | {verdict} |")
    return rows


STYLES = {
    UNPIPELINED: {"color": "black", "linestyle": "-", "linewidth": 2.6, "zorder": 3},
    OTHER_INIT: {"color": "0.6", "linestyle": ":", "linewidth": 1.8, "zorder": 2},
    "1f1b": {
        "color": "tab:blue",
        "linestyle": "--",
        "linewidth": 1.6,
        "marker": "o",
        "markersize": 3,
        "zorder": 4,
    },
    "pipedream": {
        "color": "tab:red",
        "linestyle": "-",
        "linewidth": 1.4,
        "marker": "s",
        "markersize": 3,
        "zorder": 5,
    },
    "2bw": {
        "color": "tab:green",
        "linestyle": "-.",
        "linewidth": 1.4,
        "marker": "^",
        "markersize": 3,
        "zorder": 5,
    },
}


def _curve(setup: Setup, history: list[Metrics]) -> tuple[list[float], list[float]]:
    """x (epochs for the CNN, thousands of windows for the GPT) and the panel's metric."""
    if setup.model == "cnn":
        return list(range(len(history))), [m["accuracy"] for m in history]
    return [epoch * setup.samples_per_epoch / 1000 for epoch in range(len(history))], [
        m["loss"] for m in history
    ]


def plot(results: list[tuple[Setup, dict[str, list[Metrics]]]], path: Path) -> None:
    """One panel per model (CNN test accuracy, GPT held-out loss), each with a zoom on the
    second half."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(results), figsize=(6.4 * len(results), 5.0))
    for axis, (setup, histories) in zip(axes, results):
        cnn = setup.model == "cnn"
        # the zoom sits where the curves are not: under them for accuracy, above them for loss
        zoom = axis.inset_axes([0.36, 0.1, 0.6, 0.5] if cnn else [0.36, 0.45, 0.6, 0.5])
        half = setup.epochs // 2
        for label, history in histories.items():
            xs, ys = _curve(setup, history)
            axis.plot(xs, ys, label=label, **STYLES[label])
            zoom.plot(xs[half:], ys[half:], **STYLES[label])
        zoom.tick_params(labelsize=8)
        zoom.grid(alpha=0.3)
        zoom.set_title("second half, zoomed", fontsize=8)
        first = [_curve(setup, h)[1][1] for h in histories.values()]
        detail = (
            f"batch {setup.batch_size}, Adam lr {setup.lr:g}, {setup.warmup:.0%} warm-up, "
            f"cosine, {setup.epochs} epochs"
        )
        if cnn:
            axis.set_title(f"CNN on digits ({detail})", fontsize=10)
            axis.set_xlabel("epoch (1437 training images)")
            axis.set_ylabel("test accuracy (%), 360 images")
            axis.set_ylim(max(0.0, min(first) - 5), 100)
        else:
            last = [h[-1]["loss"] for h in histories.values()]
            axis.set_title(f"byte GPT on stdlib source ({detail})", fontsize=10)
            axis.set_xlabel(
                f"training windows of 64 bytes, thousands (epoch = {setup.samples_per_epoch})"
            )
            axis.set_ylabel("held-out loss (nats/byte)")
            axis.set_ylim(min(last) - 0.1, max(first) + 0.15)
        axis.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="upper center", ncol=len(labels), frameon=False)
    figure.suptitle(
        f"{STAGES} pipeline stages on {STAGES} processes; same initial weights, data order, "
        "batch and lr (except 'other init')",
        y=0.93,
        fontsize=9,
        color="0.3",
    )
    figure.tight_layout(rect=(0, 0, 1, 0.91))
    figure.savefig(path, dpi=130)
    plt.close(figure)


def main() -> None:
    """Train every run of both models, print the table and write the plot."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run (about a minute)")
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="PNG to write (default benchmarks/convergence.png, or convergence_quick.png "
        "with --quick)",
    )
    parser.add_argument(
        "--gpt-lr", type=float, default=3e-3, help="the GPT's peak learning rate (default 3e-3)"
    )
    parser.add_argument(
        "--gpt-epochs",
        type=int,
        default=28,
        help="the GPT's training budget in epochs (default 28)",
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=0.1,
        help="share of the updates with a linearly rising learning rate, every run (default 0.1)",
    )
    args = parser.parse_args()
    if not 0 <= args.warmup < 1:
        parser.error(f"--warmup must be in [0, 1), got {args.warmup}")
    path = args.plot or Path(__file__).with_name(
        "convergence_quick.png" if args.quick else "convergence.png"
    )
    results = []
    for setup in setups(args.quick, args.gpt_lr, args.gpt_epochs, args.warmup):
        print(
            f"{setup.model}: {setup.epochs} epochs of {setup.updates_per_epoch} updates x "
            f"{setup.batch_size} samples; 1f1b/2bw {setup.microbatches} micro-batches per "
            f"update; pipedream/2bw {setup.window} updates per call",
            flush=True,
        )
        results.append((setup, run_all(setup)))
    print()
    print("| model | run | test accuracy | Δ accuracy | held-out loss | Δ loss | within target |")
    print("|---|---|---:|---:|---:|---:|:---:|")
    for setup, histories in results:
        print("\n".join(table(setup, histories)))
    print(
        f"\ntarget: accuracy within {ACCURACY_TARGET_PP:g} pp (CNN), loss within "
        f"{LOSS_TARGET_PCT:g}% (GPT) of unpipelined"
    )
    plot(results, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
