"""The PipeDream-2BW update rule replayed in one process, beside plain training, on the GPT.

No pipeline: one process with one thread trains the built-in byte GPT twice from the same
initial weights and data order, once with plain mini-batch Adam and once with 2BW's rule,
W(t+1) = W(t) − Adam(∇f(W(t−1))): every update's gradient is computed on the weights one
update old. The learning rate rises linearly over the first ``--warmup`` share of the
updates, then decays as a cosine, changed at every update; there are no drains. This
separates what the rule costs from what the runtime does, and shows how the lr schedule
and the budget change that cost.

    python benchmarks/replay_2bw.py [--epochs 14] [--warmup 0] [--clip 0] [--lr 3e-3]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from pipetrain.app.data import BatchStream
from pipetrain.app.models import build_model, loss_function

MODEL = "gpt"
BATCH = 32
UPDATES_PER_EPOCH = 132  # as in bench_convergence.py


def learning_rate(peak: float, warmup: float, update: int, total: int) -> float:
    """Linear warm-up over ``warmup × total`` updates, then cosine decay to 0."""
    warm = int(warmup * total)
    if update < warm:
        return peak * (update + 1) / warm
    return peak * 0.5 * (1 + math.cos(math.pi * (update - warm) / (total - warm)))


def train(stale: bool, peak: float, warmup: float, clip: float, epochs: int) -> list[float]:
    """Held-out loss after each epoch; ``stale`` computes each gradient on the previous weights."""
    torch.set_num_threads(1)
    model = build_model(MODEL, seed=0)
    loss_fn = loss_function(MODEL)
    optimizer = torch.optim.Adam(model.parameters(), lr=peak)
    stream = BatchStream(MODEL, BATCH, seed=0)
    eval_inputs, eval_targets = stream.eval_set()
    total = epochs * UPDATES_PER_EPOCH
    previous = None  # W(t−1), for the stale rule
    history = []
    for update in range(total):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(peak, warmup, update, total)
        inputs, targets = next(stream)
        optimizer.zero_grad()
        if stale:
            current = {k: v.detach().clone() for k, v in model.state_dict().items()}
            if previous is not None:
                model.load_state_dict(previous)
            loss_fn(model(inputs), targets).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            model.load_state_dict(current)
            for parameter, grad in zip(model.parameters(), grads):
                parameter.grad = grad
            previous = current
        else:
            loss_fn(model(inputs), targets).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if (update + 1) % UPDATES_PER_EPOCH == 0:
            with torch.no_grad():
                history.append(float(loss_fn(model(eval_inputs), eval_targets)))
    return history


def main() -> None:
    """Train both ways and print the held-out losses and the gap."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=14)
    parser.add_argument(
        "--warmup", type=float, default=0.0, help="share of the updates with a rising lr"
    )
    parser.add_argument("--clip", type=float, default=0.0, help="gradient-norm clipping (0: none)")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    if not 0 <= args.warmup < 1:
        parser.error(f"--warmup must be in [0, 1), got {args.warmup}")
    finals = {}
    for label, stale in (("unpipelined", False), ("2BW rule", True)):
        began = time.perf_counter()
        history = train(stale, args.lr, args.warmup, args.clip, args.epochs)
        finals[label] = history[-1]
        losses = " ".join(f"{loss:.4f}" for loss in history)
        print(f"{label:12} {losses}  ({time.perf_counter() - began:.0f} s)", flush=True)
    gap = 100 * (finals["2BW rule"] - finals["unpipelined"]) / finals["unpipelined"]
    print(
        f"final held-out loss: unpipelined {finals['unpipelined']:.4f}, "
        f"2BW rule {finals['2BW rule']:.4f} ({gap:+.1f}%)"
    )


if __name__ == "__main__":
    main()
