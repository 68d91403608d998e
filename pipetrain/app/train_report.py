"""The outcome of a ``pipetrain train`` run: losses, step times, and the last step measured
beside the simulator's prediction on the costs measured in it."""

from __future__ import annotations

import collections
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipetrain.app.step_costs import calibrated, predicted_steps
from pipetrain.app.train_config import WARMUP_STEPS, TrainConfig
from pipetrain.schedules import Schedule
from pipetrain.simulation import Costs, measured_costs, simulate
from pipetrain.timeline import Timeline, format_seconds, plot_timelines
from pipetrain.units import counted

DIVERGENCE_FACTOR = 10.0
"""A run whose final loss exceeds its first this many times over has diverged."""


def divergence(losses: list[float]) -> str | None:
    """Why a run with these per-step ``losses`` counts as diverged, or ``None``: its last
    tenth of steps' mean loss is more than :data:`DIVERGENCE_FACTOR` times its first step's."""
    tail = losses[-max(1, len(losses) // 10) :]
    final = sum(tail) / len(tail)
    if not final > DIVERGENCE_FACTOR * losses[0]:
        return None
    return (
        f"the run diverged: loss {losses[0]:.4g} at the first step, {final:.4g} "
        f"over the last {len(tail)}; lower --lr, or clip with --max-grad-norm"
    )


def run_keys(
    config: TrainConfig,
    losses: list[float],
    step_times_s: list[float],
    evaluations: list[dict[str, float]],
    step_s: float,
    bytes_sent: list[int],
) -> dict[str, Any]:
    """The JSON keys every ``pipetrain train`` report has: the settings, the losses and
    held-out metrics, the step times, and the bytes each worker's host sent over its network
    interfaces (not loopback) from the first step to the last."""
    return {
        "model": config.model,
        "batch_size": config.batch_size,
        "steps": config.steps,
        "lr": config.lr,
        "accumulate": config.accumulate,
        "max_grad_norm": config.update.max_grad_norm,
        "lr_schedule": config.lr_schedule,
        "precision": config.update.precision,
        "eval_every": config.eval_every,
        "eval": evaluations,
        "losses": losses,
        "final_loss": losses[-1],
        "step_times_s": step_times_s,
        "step_s": step_s,
        "samples_per_s": config.samples / step_s,
        "training_bytes_sent": bytes_sent,
        "diverged": divergence(losses) is not None,
    }


def _listed(counts: Sequence[int] | None) -> list[int] | None:
    return None if counts is None else list(counts)


def _placement(config: TrainConfig) -> str:
    """``"2 ranks"``, or ``"2 stages on 3 ranks"`` when stages are replicated or a rank
    holds several."""
    schedule, ranks = config.built, config.workers
    if schedule.stages == ranks:
        return counted(ranks, "rank")
    replicas = config.pipeline.replicas
    how = f" (replicas {', '.join(map(str, replicas))})" if replicas else ""
    if config.pipeline.data_parallel > 1:
        how = f" ({config.pipeline.data_parallel} replicas each)"
    how += ", sharded" if config.pipeline.shard else ""
    tp = config.pipeline.tensor_parallel
    how += f", tensor-parallel over {tp}" if tp > 1 else ""
    return f"{counted(schedule.stages, 'stage')} on {counted(ranks, 'rank')}{how}"


def split_sizes(samples: int, parts: int) -> str:
    """``"4 micro-batches of 4 samples"``, or of ``"2-3 samples"`` where ``parts`` does not
    divide ``samples`` (the batch is split as evenly as it goes, as the pipeline splits it)."""
    size, left = divmod(samples, parts)
    sizes = f"{size}" if not left else f"{size}-{size + 1}"
    return (
        f"{counted(parts, 'micro-batch', 'micro-batches')} of {sizes} "
        f"{'sample' if sizes == '1' else 'samples'}"
    )


@dataclass(frozen=True)
class TrainReport:
    """The outcome of a run: losses and step times, and the last step measured and predicted."""

    config: TrainConfig
    losses: list[float]
    step_times_s: list[float]
    measured: Timeline
    predicted: Timeline
    costs: Costs
    evaluations: list[dict[str, float]] = field(default_factory=list)
    bytes_sent: list[int] = field(default_factory=list)
    last_schedule: Schedule | None = None
    tokens: list[int] = field(default_factory=list)
    step_predicted_s: list[float] = field(default_factory=list)
    choices: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def build(cls, config: TrainConfig, result: dict[str, Any]) -> TrainReport:
        """Combine rank 0's result with the simulator's prediction on the measured costs."""
        measured = Timeline.from_dict(result["timeline"])
        # with a token budget the last step's micro-batch count is its own
        played = {e.microbatch for e in measured.events if e.microbatch is not None}
        budgeted = config.pipeline.microbatch_tokens is not None
        schedule = config.schedule_for(len(played) if budgeted else None)
        costs = measured_costs(measured, schedule.stages)
        predicted = simulate(schedule, costs)
        shapes = result.get("shapes", [])
        per_step = predicted_steps(config, shapes, costs) if shapes else []
        return cls(
            config,
            result["losses"],
            result["step_times_s"],
            measured,
            predicted,
            costs,
            result.get("eval", []),
            result.get("bytes_sent", []),
            schedule,
            result.get("tokens", []),
            per_step,
            result.get("choices", []),
        )

    @property
    def step_s(self) -> float:
        """Median step time in seconds, leaving out the warm-up steps when there are more."""
        steady = self.step_times_s[WARMUP_STEPS:] or self.step_times_s
        return statistics.median(steady)

    @property
    def samples_per_s(self) -> float:
        """Training samples per second at the median step time."""
        return self.config.samples / self.step_s

    @property
    def tokens_per_s(self) -> float | None:
        """For a corpus of one's own, the mean counted tokens of a step over the median
        step time (``None`` otherwise)."""
        return statistics.mean(self.tokens) / self.step_s if self.tokens else None

    def to_json(self) -> dict[str, Any]:
        """The JSON object printed by ``pipetrain train --json``."""
        config = self.config
        return {
            **run_keys(
                config,
                self.losses,
                self.step_times_s,
                self.evaluations,
                self.step_s,
                self.bytes_sent,
            ),
            "schedule": config.built.name,
            "ranks": config.ranks,
            "stages": config.built.stages,
            "microbatches": config.pipeline.microbatches,
            "microbatches_per_call": config.built.microbatches,
            "bubble_fraction": self.measured.bubble_fraction,
            "recorded_step_s": self.measured.makespan,
            "predicted_step_s": self.predicted.makespan,
            "predicted_bubble_fraction": self.predicted.bubble_fraction,
            "planned_step_s": config.planned_step_s,
            "planned_topology": config.planned_topology,
            "balance": _listed(config.pipeline.balance),
            "replicas": _listed(config.pipeline.replicas),
            "data_parallel": config.pipeline.data_parallel,
            "shard": config.pipeline.shard,
            "microbatch_tokens": config.pipeline.microbatch_tokens,
            "last_step_microbatches": self._last().microbatches,
            "tokens_per_s": self.tokens_per_s,
            "step_predicted_s": self.step_predicted_s,
            "step_prediction_error": self._prediction_error(),
            "step_prediction_error_calibrated": self._prediction_error(calibrate=True),
            "adaptive_choices": self.choices,
        }

    def _steady_pairs(self, calibrate: bool = False) -> list[tuple[float, float]]:
        """(predicted, measured) of the steps this run made after its warm-up steps, each
        prediction ``calibrate``-d by the steps before it (:func:`calibrated`)."""
        made = self.step_times_s[-len(self.step_predicted_s) :] if self.step_predicted_s else []
        guesses = self.step_predicted_s
        if calibrate:
            guesses = calibrated(guesses, made, WARMUP_STEPS)
        pairs = list(zip(guesses, made))
        return pairs[WARMUP_STEPS:] or pairs

    def _prediction_error(self, calibrate: bool = False) -> float | None:
        """The median over steps of |predicted − measured| / measured."""
        pairs = self._steady_pairs(calibrate)
        if not pairs:
            return None
        return statistics.median(abs(p - m) / m for p, m in pairs)

    def _last(self) -> Schedule:
        return self.last_schedule or self.config.built

    def divergence(self) -> str | None:
        """Why the run counts as diverged (see :func:`divergence`), or ``None``."""
        return divergence(self.losses)

    def summary(self) -> str:
        """A few readable lines: loss, step time, throughput, measured against predicted."""
        config, measured, predicted = self.config, self.measured, self.predicted
        steady = (
            f"steps {WARMUP_STEPS + 1}-{config.steps}"
            if config.steps > WARMUP_STEPS
            else "all steps"
        )
        # an asynchronous step may hold several updates of ``microbatches`` each
        in_step, microbatches = config.built.microbatches, config.pipeline.microbatches
        per_update = "" if in_step == microbatches else f", {microbatches} an update"
        split = split_sizes(config.samples, in_step)
        budget = config.pipeline.microbatch_tokens
        if config.data is not None and config.data.pack:
            split = (
                f"{config.samples} documents packed into rows of at most "
                f"{config.data.seq_len_max} tokens, "
                f"{counted(in_step, 'micro-batch', 'micro-batches')}"
            )
        if budget is not None:
            per_update = ""
            how = (
                f"as each step's simulation found fastest, budgets around {budget} tokens"
                if config.adaptive
                else f"of at most {budget} tokens"
            )
            split = f"micro-batches {how} ({self._last().microbatches} in the last step)"
        tokens = self.tokens_per_s
        throughput = f"{self.samples_per_s:,.0f} samples/s" + (
            "" if tokens is None else f", {tokens:,.0f} tokens/s"
        )
        stage_costs = " | ".join(
            f"{name} " + ", ".join(format_seconds(v) for v in getattr(self.costs, field))
            for name, field in (("F", "forward_s"), ("B", "backward_s"), ("W", "weight_s"))
            if any(getattr(self.costs, field))
        )
        planned = (
            []
            if config.planned_step_s is None
            else [
                (
                    f"  planned           {format_seconds(config.planned_step_s)} a step, "
                    f"{config.planned_step_s / self.step_s:.2f} × the median step "
                    "(the plan's prediction from the profile)"
                )
            ]
        )
        held = [
            f"  held-out          after step {last['step']:g}: "
            + ", ".join(f"{name} {value:.4f}" for name, value in last.items() if name != "step")
            for last in self.evaluations[-1:]
        ]
        schedule = "" if config.lr_schedule == "constant" else f", {config.lr_schedule}"
        precision = config.update.precision
        precision = "" if precision == "fp32" else f", {precision}"
        return "\n".join(
            [
                f"{config.model} on {_placement(config)}, {config.built.name}, "
                f"{split}{per_update}, {counted(config.steps, 'step')} "
                f"(Adam, lr {config.lr:g}{schedule}{precision})",
                f"  loss              {self.losses[0]:.4f} -> {self.losses[-1]:.4f}",
                *held,
                f"  step time         {format_seconds(self.step_s)} (median of {steady})",
                f"  throughput        {throughput}",
                f"  last step         measured {format_seconds(measured.makespan)}, "
                f"bubble {measured.bubble_fraction:.1%}",
                f"  predicted         {format_seconds(predicted.makespan)}, "
                f"bubble {predicted.bubble_fraction:.1%} "
                f"({config.built.name} simulated on the measured stage costs)",
                f"  stage costs       {stage_costs} (median per micro-batch, by stage)",
                f"  messages          send {format_seconds(self.costs.send_s)} (median), "
                f"receive {format_seconds(self.costs.receive_s)} (shortest), "
                f"latency {format_seconds(self.costs.latency_s)}",
                *planned,
                *self._length_lines(),
            ]
        )

    def _length_lines(self) -> list[str]:
        """For a corpus of one's own: the steps predicted one by one, and what
        ``--adaptive`` chose."""
        pairs = self._steady_pairs()
        lines = []
        if pairs:
            lines.append(
                f"  per step          predicted median "
                f"{format_seconds(statistics.median(p for p, _ in pairs))}, measured "
                f"{format_seconds(statistics.median(m for _, m in pairs))}; median error "
                f"{self._prediction_error():.0%} (sequence lengths priced by the profiled GPT), "
                f"{self._prediction_error(calibrate=True):.0%} calibrated by the steps before"
            )
        if self.choices:
            counts = collections.Counter(choice["formation"] for choice in self.choices)
            gain = statistics.median(choice["predicted_gain"] for choice in self.choices)
            lines.append(
                "  adaptive          "
                + ", ".join(f"{name} {count}" for name, count in counts.most_common())
                + f" steps; predicted {gain:.2f}x the consecutive micro-batches (median)"
            )
        return lines

    def write_trace(self, path: str) -> None:
        """Write the last step: a PNG of predicted above measured, or the measured Chrome
        trace; with ``--adaptive``, titled with the step's chosen formation and its
        predicted gain."""
        name = self.config.built.name
        chosen = ""
        if self.choices:  # the last step's formation, as --adaptive chose it
            last = self.choices[-1]
            chosen = (
                f"; adaptive: {last['formation']}, predicted {last['predicted_gain']:.2f}x "
                "the consecutive micro-batches"
            )
        if path.lower().endswith(".png"):
            titles = [f"{name} predicted (measured costs){chosen}", f"{name} measured{chosen}"]
            plot_timelines([self.predicted, self.measured], path, titles)
        else:
            measured = self.measured.shifted()
            label = f"{measured.label or name}{chosen}"
            Timeline(measured.events, measured.num_ranks, label).to_chrome_trace(path)
