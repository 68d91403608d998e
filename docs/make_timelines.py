"""Draw the simulated timeline of every registered schedule at 4 ranks x 8 micro-batches
into docs/timelines/.

Costs per micro-batch are each schedule's defaults (forward 1, backward 2; the
split-backward families, zb-h1, interleaved-zb, zb-v, v-half, v-min and dualpipev, split
it into B = W = 1 with forward 1, as in the zero-bubble papers; overlapped pairs hide
nothing), a rank's time shared by its chunks (2 for interleaved, looped-bfs,
interleaved-zb, the V families and roundpipe's 8 stages). Run with ``make timelines``.
"""

from __future__ import annotations

from pathlib import Path

from pipetrain.schedules import build, names, spec
from pipetrain.simulation import Costs, simulate

RANKS, MICROBATCHES = 4, 8
OUT = Path(__file__).resolve().parent / "timelines"


def costs_for(name: str, stages: int) -> Costs:
    """The schedule's default costs, a rank's time shared by its ``stages / RANKS`` chunks."""
    chunks = stages / RANKS
    return Costs(**{field: value / chunks for field, value in spec(name).default_costs.items()})


def title_for(name: str) -> str:
    """The chart title: the schedule and the shape drawn."""
    return f"{name}: {RANKS} ranks, {MICROBATCHES} micro-batches"


def main() -> None:
    """Write ``docs/timelines/<schedule>.png`` for every registered schedule."""
    OUT.mkdir(exist_ok=True)
    for name in names():
        schedule = build(name, RANKS, MICROBATCHES)
        timeline = simulate(schedule, costs_for(name, schedule.stages))
        path = OUT / f"{name}.png"
        timeline.plot(path, title_for(name))
        print(
            f"{path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}: "
            f"makespan {timeline.makespan:g}, bubble {timeline.bubble_fraction:.1%}"
        )


if __name__ == "__main__":
    main()
