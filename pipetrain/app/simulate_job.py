"""A simulation as ``pipetrain simulate`` does it: costs from defaults, a file and flags;
the simulated step; and the textbook bubble formula to compare with, where one applies.

Costs are seconds per micro-batch and stage. For ``interleaved`` they are per rank and shared
equally by the rank's model chunks (or, as a list, one value per model stage).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

from pipetrain.schedules import Schedule, build
from pipetrain.simulation import Costs, simulate
from pipetrain.timeline import Timeline

COST_FIELDS = tuple(f.name for f in fields(Costs))
"""The fields a costs file may hold."""

DEFAULT_COSTS = {"forward_s": 1.0, "backward_s": 2.0}
ZERO_BUBBLE_DEFAULT_COSTS = {"forward_s": 1.0, "backward_s": 1.0, "weight_s": 1.0}
"""zb-h1's defaults: F = B = W, as in the zero-bubble paper's figures."""

# time fields that, for interleaved, are given per rank and shared among its model chunks
PER_RANK_TIME_FIELDS = ("forward_s", "backward_s", "weight_s", "step_s")


def read_costs_file(path: str) -> dict[str, Any]:
    """The Costs fields in the JSON object at ``path``, checked for names and value types."""
    try:
        with open(path, encoding="utf-8") as file:
            values = json.load(file)
    except OSError as error:
        raise ValueError(f"cannot read costs file {path!r}: {error.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"costs file {path!r} is not valid JSON: {error}") from None
    if not isinstance(values, dict):
        raise ValueError(
            f'costs file {path!r} must hold a JSON object such as {{"forward_s": 1.0}}'
        )
    unknown = sorted(set(values) - set(COST_FIELDS))
    if unknown:
        raise ValueError(
            f"costs file {path!r} has unknown field(s) {unknown}; allowed: {', '.join(COST_FIELDS)}"
        )
    for name, value in values.items():
        per_stage = (
            name != "latency_s"
            and isinstance(value, list)
            and value
            and all(map(_is_number, value))
        )
        if not (_is_number(value) or per_stage):
            expected = (
                "a number"
                if name == "latency_s"
                else "a number or a list of numbers (one per stage)"
            )
            raise ValueError(f"costs file {path!r}: {name} is {value!r}; give {expected}")
    return values


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def requested_costs(
    schedule_name: str,
    costs_file: str | None = None,
    forward_s: float | None = None,
    backward_s: float | None = None,
    weight_s: float | None = None,
) -> dict[str, Any]:
    """The cost values asked for: the defaults, overridden by the file, overridden by the flags."""
    given = read_costs_file(costs_file) if costs_file else {}
    flags = {"forward_s": forward_s, "backward_s": backward_s, "weight_s": weight_s}
    given.update({name: value for name, value in flags.items() if value is not None})
    defaults = ZERO_BUBBLE_DEFAULT_COSTS if schedule_name == "zb-h1" else DEFAULT_COSTS
    return {**defaults, **given}


def schedule_costs(schedule: Schedule, values: dict[str, Any]) -> Costs:
    """Costs for ``schedule`` from per-rank values: a rank's time is shared by the stages it holds.

    A list with one value per model stage is taken as it is.
    """
    converted = dict(values)
    for name in PER_RANK_TIME_FIELDS:
        value = values.get(name)
        if value is None or schedule.num_ranks == schedule.stages:
            continue
        if _is_number(value):
            per_rank = [float(value)] * schedule.num_ranks
        elif len(value) == schedule.num_ranks:
            per_rank = value
        else:
            continue  # one value per model stage, or a length that Costs rejects by name
        converted[name] = [
            per_rank[ranks[0]] / len(schedule.stages_of(ranks[0])) for ranks in schedule.stage_ranks
        ]
    return Costs(**converted)


def textbook_bubble(schedule: Schedule, costs: Costs) -> tuple[str, float] | None:
    """The closed-form bubble fraction and its formula, for uniform costs without
    communication or optimizer-step time; ``None`` where no formula applies."""
    p, m, stages = schedule.num_ranks, schedule.microbatches, schedule.stages
    forward, backward, weight = (
        costs.per_stage(name, stages) for name in ("forward_s", "backward_s", "weight_s")
    )
    boundaries = max(stages - 1, 1)
    uniform = all(len(set(values)) == 1 for values in (forward, backward, weight))
    no_transfers = costs.latency_s == 0 and all(
        size == 0 or math.isinf(speed)
        for size, speed in zip(
            costs.per_stage("activation_bytes", boundaries),
            costs.per_stage("bandwidth", boundaries),
        )
    )
    no_steps = not any(costs.per_stage("step_s", stages))
    replicated = any(len(ranks) > 1 for ranks in schedule.stage_ranks)
    if not (uniform and no_transfers and no_steps) or replicated:
        return None
    if schedule.name == "interleaved":
        v = schedule.options["virtual"]
        return "(p-1)/(v*m+p-1)", (p - 1) / (v * m + p - 1)
    if schedule.name == "2bw":  # m counts every micro-batch of the r updates in the window
        return "(p-1)/(r*m+p-1)", (p - 1) / (m + p - 1)
    if schedule.name == "zb-h1":
        f, b, w = forward[0], backward[0], weight[0]
        if m < p or w > min(
            f, b
        ):  # outside the conditions the zero-bubble paper's count holds under
            return None
        idle = (p - 1) * (f + b - w)
        return "(p-1)(F+B-W)/(m(F+B+W)+(p-1)(F+B-W))", idle / (m * (f + b + w) + idle)
    return "(p-1)/(m+p-1)", (p - 1) / (m + p - 1)


@dataclass(frozen=True)
class SimulateResult:
    """One simulated step: what was asked, the schedule, the timeline and the textbook value."""

    name: str
    stages: int
    microbatches: int
    schedule: Schedule
    requested: dict[str, Any]  # cost values as given: per stage, or per rank for interleaved
    timeline: Timeline
    textbook: tuple[str, float] | None

    def to_json(self) -> dict[str, Any]:
        """The JSON object printed by ``pipetrain simulate --json``."""
        formula, value = self.textbook or (None, None)
        return {
            "schedule": self.name,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "model_stages": self.schedule.stages,
            "makespan": self.timeline.makespan,
            "bubble_fraction": self.timeline.bubble_fraction,
            "peak_activations": self.timeline.peak_activations,
            "textbook_formula": formula,
            "textbook_bubble_fraction": value,
            "costs": {name: _finite_or_none(value) for name, value in self.requested.items()},
        }


def _finite_or_none(value: Any) -> Any:
    """JSON has no infinity: non-finite numbers become ``null``."""
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    return value if not isinstance(value, float) or math.isfinite(value) else None


def run_simulation(
    name: str,
    stages: int,
    microbatches: int,
    *,
    virtual: int = 2,
    costs_file: str | None = None,
    forward_s: float | None = None,
    backward_s: float | None = None,
    weight_s: float | None = None,
) -> SimulateResult:
    """Build schedule ``name``, simulate it on the requested costs, and find its textbook bubble."""
    options = {"virtual": virtual} if name == "interleaved" else {}
    schedule = build(name, stages, microbatches, **options)
    requested = requested_costs(name, costs_file, forward_s, backward_s, weight_s)
    costs = schedule_costs(schedule, requested)
    timeline = simulate(schedule, costs)
    return SimulateResult(
        name, stages, microbatches, schedule, requested, timeline, textbook_bubble(schedule, costs)
    )
