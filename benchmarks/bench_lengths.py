"""Documents of every length: tokens per second and time to a held-out loss, by how each
step's documents are formed into micro-batches.

The corpus is the standard library's sources (``pipetrain.app.data.stdlib_corpus``) as a
text file whose documents are split at blank lines (bytes; median 151, mean 230, the
longest cut at ``--seq-len-max`` 1024): a skewed distribution. The built-in GPT trains on
``--ranks`` gloo workers (1F1B, Adam), each step ``--batch`` documents in corpus order,
formed four ways:

- ``pad-longest``: the step padded to its longest document, ``--microbatches`` equal parts;
- ``pack``: documents packed several to a row of ``--seq-len-max`` tokens (positions and
  attention kept within each document), split into ``--microbatches``;
- ``pad-each``: ``--microbatches`` consecutive groups, each padded to its own longest;
- ``token-budget``: ``microbatch_tokens=--budget``, longest first, the count per step free;
- ``adaptive``: each step, the fastest of ``train --adaptive``'s candidates (consecutive,
  by length, half/once/twice the budget) simulated on the fitted costs, its choice timed
  with the step.

Every formation computes the same token-mean loss on the same documents, so their losses
agree step for step (checked) and reach a held-out loss at the same step: time to it is
the step times summed to there. Tokens per second counts real tokens (no padding) over the
measured steps' total time; the first ``WARMUP`` steps of each are left out.

Each step is also predicted: the GPT's layers are profiled alone at five shapes, one torch
thread as each rank runs, and fitted (:func:`pipetrain.app.step_costs.profiled_gpt`); each
step's micro-batch shapes give its costs (messages as measured in the formation's last
step), and the simulator, with
the ranks sharing the cores, plays the step; the table gives the median of
|predicted − measured| / measured over the steps, raw and with each prediction calibrated
by the steps before it (:func:`pipetrain.app.step_costs.calibrated`, as ``pipetrain
train`` reports it).

    python benchmarks/bench_lengths.py [--steps 60] [--ranks 4]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from functools import partial
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

import pipetrain
from pipetrain.app.corpus_stream import CorpusSettings, CorpusStream, next_token_pair
from pipetrain.app.data import stdlib_corpus
from pipetrain.app.models import build_model
from pipetrain.app.models.gpt import gpt_token_loss
from pipetrain.app.step_costs import StepPricer, calibrated, profiled_gpt
from pipetrain.app.step_costs import shapes_of as step_shapes
from pipetrain.data.batches import (
    IGNORE_INDEX,
    fixed_groups,
    pack_groups,
    packed,
    token_budget_groups,
)
from pipetrain.profiler.lengths import LengthCosts, Shape
from pipetrain.runtime import Sequences
from pipetrain.simulation import measured_costs
from pipetrain.timeline import Timeline

FORMATIONS = ("pad-longest", "pack", "pad-each", "token-budget", "adaptive")
WARMUP, EVAL_EVERY = 3, 10


def steps_of(settings: CorpusSettings, batch: int, steps: int) -> list[list[torch.Tensor]]:
    """Each step's documents as (inputs, targets) pairs, read before any timing."""
    stream = CorpusStream(settings, batch)
    return [[next_token_pair(ids) for ids in next(stream.batches)] for _ in range(steps)]


def formed(formation: str, pairs: list[Any], microbatches: int, seq_len_max: int) -> Any:
    """A step's ``(inputs, targets)`` as ``formation`` gives them to ``train_step``."""
    inputs, targets = [x for x, _ in pairs], [y for _, y in pairs]
    if formation == "pad-longest":
        return (
            pad_sequence(inputs, batch_first=True),
            pad_sequence(targets, batch_first=True, padding_value=IGNORE_INDEX),
        )
    if formation == "pack":
        return packed(pairs, seq_len_max, microbatches)
    return Sequences(inputs), Sequences(targets)


def chosen(pricer: StepPricer, pairs: list[Any], args: argparse.Namespace) -> list[list[int]]:
    """``--adaptive``'s groups for a step: the fastest candidate simulated."""
    lengths = [len(x) for x, _ in pairs]
    return pricer.choose(lengths, args.microbatches, args.budget)[1]


def run(
    formation: str,
    args: argparse.Namespace,
    path: str,
    held: tuple[torch.Tensor, torch.Tensor],
    fitted: LengthCosts,
) -> dict[str, Any]:
    """Worker: train ``--steps`` steps formed as ``formation``; rank 0's losses, step
    times (an adaptive step's choice included), tokens and (for the first formation)
    held-out losses."""
    settings = CorpusSettings(path, seq_len_max=args.seq_len_max, eval_fraction=0.02)
    model = gpt(args)
    budget = args.budget if formation in ("token-budget", "adaptive") else None
    pipe = pipetrain.Pipeline(
        model,
        loss_fn=gpt_token_loss,
        optimizer=partial(torch.optim.Adam, lr=3e-3),
        config=pipetrain.PipelineConfig(
            schedule="1f1b", microbatches=args.microbatches, microbatch_tokens=budget
        ),
    )
    pricer = StepPricer(fitted, "1f1b", args.ranks, list(pipe.balance))
    losses, times, tokens, evaluations = [], [], [], []
    for step, pairs in enumerate(steps_of(settings, args.batch, args.steps)):
        pipe.recorder.enabled = step == args.steps - 1
        torch.distributed.barrier()
        start = time.perf_counter()
        if formation == "adaptive":
            groups = chosen(pricer, pairs, args)
            inputs = Sequences([x for x, _ in pairs], groups)
            targets = Sequences([y for _, y in pairs], groups)
        else:
            inputs, targets = formed(formation, pairs, args.microbatches, args.seq_len_max)
        losses.append(pipe.train_step(inputs, targets))
        times.append(time.perf_counter() - start)
        tokens.append(sum(int((y != IGNORE_INDEX).sum()) for _, y in pairs))
        if formation == FORMATIONS[0] and (step + 1) % EVAL_EVERY == 0:
            logits = pipe.eval_step(held[0], to=0)
            if logits is not None:
                total, count = gpt_token_loss(logits, held[1])
                evaluations.append((step + 1, float(total / count)))
    timeline = pipe.timeline()
    return {
        "losses": losses,
        "times": times,
        "tokens": tokens,
        "eval": evaluations,
        "balance": list(pipe.balance),
        "timeline": None if timeline is None else timeline.to_dict(),
    }


def gpt(args: argparse.Namespace) -> torch.nn.Sequential:
    """The built-in GPT (6 layers, width 64) with a context of ``--seq-len-max``."""
    return build_model("gpt", seed=0, context=args.seq_len_max)


def shapes_of(
    formation: str, pairs: list[Any], args: argparse.Namespace, pricer: StepPricer
) -> list[Shape]:
    """The ``(rows, length)`` of each micro-batch a step's documents form."""
    lengths = [len(x) for x, _ in pairs]
    if formation == "adaptive":
        return step_shapes(lengths, chosen(pricer, pairs, args))
    if formation == "pack":
        groups = pack_groups(lengths, args.seq_len_max, args.microbatches)
        width = max(sum(lengths[i] for i in g) for g in groups)
        return [(len(part), width) for part in fixed_groups(len(groups), args.microbatches)]
    if formation == "token-budget":
        groups = token_budget_groups(lengths, args.budget)
    else:
        groups = fixed_groups(len(lengths), args.microbatches)
    if formation == "pad-longest":
        return [(len(g), max(lengths)) for g in groups]
    return [(len(g), max(lengths[i] for i in g)) for g in groups]


def predicted(
    result: dict[str, Any], shapes: list[list[Shape]], fitted: LengthCosts, ranks: int
) -> list[float]:
    """Each step's simulated time on the fitted costs, the ranks sharing the cores."""
    stages = len(result["balance"])
    base = measured_costs(Timeline.from_dict(result["timeline"]), stages)
    pricer = StepPricer(fitted, "1f1b", ranks, result["balance"], base=base)
    cores = len(os.sched_getaffinity(0))
    return [pricer.step_s(step, cores) for step in shapes]


def compute_ratio(result: dict[str, Any], shapes: list[Shape], fitted: LengthCosts) -> float:
    """The last step's measured forward and backward time over what the fitted costs give
    its micro-batches (every rank's summed): the compute model's own error, apart from
    the schedule's waits and the cores' sharing."""
    timeline = Timeline.from_dict(result["timeline"])
    measured = predicted = 0.0
    for event in timeline.events:
        if event.kind in ("F", "B") and event.microbatch is not None and event.stage is not None:
            forward, backward = fitted.stage_seconds(result["balance"], shapes[event.microbatch])
            measured += event.duration
            predicted += (forward if event.kind == "F" else backward)[event.stage]
    return measured / predicted


def held_out(path: str, seq_len_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    settings = CorpusSettings(path, seq_len_max=seq_len_max, eval_fraction=0.02)
    return CorpusStream(settings, 1).eval_set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--seq-len-max", type=int, default=1024)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        path = f"{directory}/stdlib.txt"
        with open(path, "wb") as out:
            out.write(bytes(stdlib_corpus(2_000_000).numpy()))
        held = held_out(path, args.seq_len_max)
        settings = CorpusSettings(path, seq_len_max=args.seq_len_max, eval_fraction=0.02)
        steps = steps_of(settings, args.batch, args.steps)
        # as each rank will run: one torch thread
        fitted = profiled_gpt(settings, seed=0, threads=1)
        results = {}
        for formation in FORMATIONS:
            results[formation] = pipetrain.launch(
                run, args.ranks, formation, args, path, held, fitted, timeout_s=1800
            )[0]
            pricer = StepPricer(fitted, "1f1b", args.ranks, results[formation]["balance"])
            shapes = [shapes_of(formation, pairs, args, pricer) for pairs in steps]
            results[formation]["predicted"] = predicted(
                results[formation], shapes, fitted, args.ranks
            )
            results[formation]["compute_ratio"] = compute_ratio(
                results[formation], shapes[-1], fitted
            )
            print(f"{formation}: done", flush=True)
    report(results)


def report(results: dict[str, dict[str, Any]]) -> None:
    baseline = results[FORMATIONS[0]]
    for name, result in results.items():
        drift = max(abs(a - b) / abs(b) for a, b in zip(result["losses"], baseline["losses"]))
        assert drift < 1e-3, f"{name}'s losses differ from {FORMATIONS[0]}'s by {drift:.2e}"
    target_step, target = baseline["eval"][-1]
    print(
        f"held-out loss {baseline['eval'][0][1]:.3f} at step {baseline['eval'][0][0]} -> "
        f"{target:.3f} at step {target_step} (the target; the same step for every formation)"
    )
    speed = {}
    print(
        "| formation | tokens/s | × pad-longest | median step | time to target "
        "| predicted: median step, median error a step | median error, calibrated "
        "| last step's F+B, measured / fitted |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, result in results.items():
        times = result["times"][WARMUP:]
        speed[name] = sum(result["tokens"][WARMUP:]) / sum(times)
        median = sorted(times)[len(times) // 2]
        to_target = sum(result["times"][:target_step])
        guesses = result["predicted"][WARMUP:]
        errors = sorted(abs(p - m) / m for p, m in zip(guesses, times))
        corrected = calibrated(result["predicted"], result["times"], WARMUP)[WARMUP:]
        calibrated_errors = sorted(abs(p - m) / m for p, m in zip(corrected, times))
        print(
            f"| {name} | {speed[name]:,.0f} | {speed[name] / speed[FORMATIONS[0]]:.2f} | "
            f"{median * 1e3:.0f} ms | {to_target:.1f} s | "
            f"{sorted(guesses)[len(guesses) // 2] * 1e3:.0f} ms, "
            f"{errors[len(errors) // 2]:.0%} | "
            f"{calibrated_errors[len(calibrated_errors) // 2]:.0%} | "
            f"{result['compute_ratio']:.2f} |"
        )
    print(f"token-budget / pack: {speed['token-budget'] / speed['pack']:.2f}")


if __name__ == "__main__":
    main()
