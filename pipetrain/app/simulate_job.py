"""A simulation as ``pipetrain simulate`` does it: costs from the schedule's defaults, a file
and flags; the simulated step; and the textbook bubble formula to compare with, where one
applies.

Costs are seconds per micro-batch and stage. For schedules with several model chunks per rank
they are per rank and shared equally by the rank's chunks (or, as a list, one value per model
stage).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

from pipetrain.schedules import Schedule, ScheduleSpec, build, names, spec
from pipetrain.simulation import Costs, simulate
from pipetrain.timeline import Timeline

COST_FIELDS = tuple(f.name for f in fields(Costs))
"""The fields a costs file may hold."""

SCALAR_FIELDS = (
    "latency_s",
    "send_s",
    "receive_s",
    "send_byte_s",
    "receive_byte_s",
    "loss_s",
    "overlap",
)
"""The fields that take one number for the whole schedule, not one per stage."""

# time fields that, with several chunks per rank, are given per rank and shared among them
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
    except RecursionError:  # the decoder recurses once per nested array or object
        raise ValueError(f"costs file {path!r} nests its JSON too deeply") from None
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
            name not in SCALAR_FIELDS
            and isinstance(value, list)
            and value
            and all(map(_is_number, value))
        )
        if not (_is_number(value) or per_stage):
            expected = (
                "a number"
                if name in SCALAR_FIELDS
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
    defaults = spec(schedule_name).default_costs if schedule_name in names() else {}
    return {"forward_s": 1.0, "backward_s": 2.0, **defaults, **given}


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
    """The closed-form bubble fraction and its formula, from the schedule's spec, for uniform
    costs without communication, optimizer-step time or host-store transfers; ``None``
    where no formula applies."""
    if schedule.name not in names():
        return None
    family, stages = spec(schedule.name), schedule.stages
    forward, backward, weight = (
        costs.per_stage(name, stages) for name in ("forward_s", "backward_s", "weight_s")
    )
    boundaries = max(stages - 1, 1)
    uniform = all(len(set(values)) == 1 for values in (forward, backward, weight))
    no_transfers = costs.latency_s == costs.send_s == costs.receive_s == 0 and all(
        size == 0 or math.isinf(speed)
        for size, speed in zip(
            costs.per_stage("activation_bytes", boundaries),
            costs.per_stage("bandwidth", boundaries),
        )
    )
    no_steps = not any(  # nor a host store's transfers
        value
        for name in ("step_s", "load_s", "offload_s")
        for value in costs.per_stage(name, stages)
    )
    replicated = any(len(ranks) > 1 for ranks in schedule.stage_ranks)
    if family.textbook_bubble is None or replicated or not (uniform and no_transfers and no_steps):
        return None
    options = family.resolve({k: v for k, v in schedule.options.items() if k in _names(family)})
    return family.textbook_bubble(
        schedule.num_ranks, schedule.microbatches, options, (forward[0], backward[0], weight[0])
    )


def _names(family: ScheduleSpec) -> set[str]:
    return {option.name for option in family.options}


@dataclass(frozen=True)
class SimulateResult:
    """One simulated step: what was asked, the schedule, the timeline and the textbook value."""

    name: str
    ranks: int
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
            "ranks": self.ranks,
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
    name: str | None,
    ranks: int | None,
    microbatches: int | None,
    *,
    options: dict[str, int | bool] | None = None,
    schedule: Schedule | None = None,
    costs_file: str | None = None,
    forward_s: float | None = None,
    backward_s: float | None = None,
    weight_s: float | None = None,
) -> SimulateResult:
    """Build schedule ``name`` (or take ``schedule``, read from a file), simulate it on the
    requested costs, and find its textbook bubble."""
    if schedule is None:
        if name is None or ranks is None or microbatches is None:
            raise ValueError("give a schedule name, ranks and micro-batches, or a schedule file")
        schedule = build(name, ranks, microbatches, replicas=None, **(options or {}))
    requested = requested_costs(schedule.name, costs_file, forward_s, backward_s, weight_s)
    costs = schedule_costs(schedule, requested)
    timeline = simulate(schedule, costs)
    return SimulateResult(
        schedule.name,
        schedule.num_ranks,
        microbatches or schedule.microbatches,
        schedule,
        requested,
        timeline,
        textbook_bubble(schedule, costs),
    )
