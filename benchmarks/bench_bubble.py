"""Measured against predicted bubble and step of recorded ``pipetrain train`` steps.

Reads the Chrome traces that ``pipetrain train --trace STEP.json`` writes (the measured
last step) and predicts each as the train report does, with the ``pipetrain`` this runs
against: :func:`~pipetrain.simulation.measured_costs` of the trace, simulated on the
schedule the run played (:meth:`~pipetrain.app.train_config.TrainConfig.schedule_for`).
Run it with another version on ``PYTHONPATH`` to see that version's prediction of the
same steps. Prints one line per trace, then the medians.

    python benchmarks/bench_bubble.py --schedule interleaved --ranks 2 --microbatches 8 \\
        interleaved-1.json interleaved-2.json
"""

from __future__ import annotations

import argparse
import json
import statistics

from pipetrain.app.train_config import TrainConfig
from pipetrain.runtime import PipelineConfig
from pipetrain.simulation import measured_costs, simulate
from pipetrain.timeline import Event, Timeline


def read_trace(path: str, ranks: int) -> Timeline:
    """The timeline in a Chrome trace written by ``Timeline.to_chrome_trace``."""
    with open(path, encoding="utf-8") as file:
        trace = json.load(file)["traceEvents"]
    events = [
        Event(
            item["tid"],
            item["cat"],
            item["args"]["stage"],
            item["args"]["microbatch"],
            item["ts"] / 1e6,
            (item["ts"] + item["dur"]) / 1e6,
        )
        for item in trace
        if item["ph"] == "X"
    ]
    return Timeline(events, ranks).shifted()


def main() -> None:
    """Print measured and predicted bubble and step for each trace, then their medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", required=True)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--model", default="gpt")
    parser.add_argument("traces", nargs="+")
    args = parser.parse_args()
    pipeline = PipelineConfig(args.schedule, args.microbatches, targets_on_first_stage=True)
    config = TrainConfig(args.model, pipeline, ranks=args.ranks).resolved(world_size=None)
    schedule = config.schedule_for()
    rows = []
    for path in args.traces:
        measured = read_trace(path, args.ranks)
        predicted = simulate(schedule, measured_costs(measured, schedule.stages))
        rows.append(
            (
                measured.bubble_fraction,
                predicted.bubble_fraction,
                measured.makespan * 1e3,
                predicted.makespan * 1e3,
            )
        )
        print(f"{path}: " + _line(rows[-1]))
    medians = tuple(statistics.median(column) for column in zip(*rows))
    print(f"median of {len(rows)}: " + _line(medians))


def _line(row: tuple[float, ...]) -> str:
    bubble, predicted_bubble, step_ms, predicted_ms = row
    return (
        f"bubble measured {bubble:.1%} predicted {predicted_bubble:.1%}, "
        f"step measured {step_ms:.1f} ms predicted {predicted_ms:.1f} ms"
    )


if __name__ == "__main__":
    main()
