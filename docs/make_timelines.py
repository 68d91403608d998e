"""Draw the simulated timeline of every schedule at 4 stages x 8 micro-batches into docs/timelines/.

Costs per micro-batch and stage: forward 1, backward 2; zb-h1 splits the backward into
B = W = 1 with forward 1, as in the zero-bubble paper; interleaved shares each rank's
costs between its 2 chunks. Run with ``make timelines``.
"""

from __future__ import annotations

from pathlib import Path

from pipetrain.schedules import SCHEDULE_NAMES, build
from pipetrain.simulation import Costs, simulate

STAGES, MICROBATCHES, VIRTUAL = 4, 8, 2
OUT = Path(__file__).resolve().parent / "timelines"


def costs_for(name: str) -> Costs:
    """The costs each schedule is drawn with (see the module docstring)."""
    if name == "zb-h1":
        return Costs(forward_s=1.0, backward_s=1.0, weight_s=1.0)
    if name == "interleaved":
        return Costs(forward_s=1.0 / VIRTUAL, backward_s=2.0 / VIRTUAL)
    return Costs(forward_s=1.0, backward_s=2.0)


def title_for(name: str) -> str:
    """The chart title: schedule, shape and what is specific to it."""
    detail = {
        "interleaved": f", {VIRTUAL} chunks per rank",
        "2bw": ", 2 updates in the window",
        "pipedream": " (asynchronous, weight stashing)",
        "zb-h1": ", F = B = W",
    }.get(name, "")
    return f"{name}: {STAGES} stages, {MICROBATCHES} micro-batches{detail}"


def main() -> None:
    """Write ``docs/timelines/<schedule>.png`` for every schedule."""
    OUT.mkdir(exist_ok=True)
    for name in SCHEDULE_NAMES:
        options = {"virtual": VIRTUAL} if name == "interleaved" else {}
        timeline = simulate(build(name, STAGES, MICROBATCHES, **options), costs_for(name))
        path = OUT / f"{name}.png"
        timeline.plot(path, title_for(name))
        print(
            f"{path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}: "
            f"makespan {timeline.makespan:g}, bubble {timeline.bubble_fraction:.1%}"
        )


if __name__ == "__main__":
    main()
