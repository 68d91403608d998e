"""The weight-version rules of asynchronous schedules, for the validator.

A forward uses a version its stage's steps have already made, its backward and weight pass
the same one, each step makes the next, a stage keeps no more live versions than the
schedule's ``max_versions`` fact allows, and with ``vertical_sync`` every stage of a
mini-batch uses the version stage 0 used.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING

from pipetrain.schedules.actions import Action, Kind
from pipetrain.schedules.errors import ScheduleError

if TYPE_CHECKING:
    from pipetrain.schedules.schedule import Schedule


def check_versions(schedule: Schedule) -> None:
    """Each forward on a version already made, its backward and weight pass on the same one,
    each step producing the next, and no more live versions than ``max_versions``.

    Run after the validator's lane pass, which has placed every compute action on one of
    the schedule's stages and micro-batches."""
    limit = schedule.options.get("max_versions")
    max_versions: float = limit if isinstance(limit, int) else math.inf
    microbatches = schedule.microbatches
    # each forward's version by stage · microbatches + micro-batch, a flat list: a long
    # window's forwards would otherwise each make and keep a key
    forward_version: list[int | None] = [None] * (schedule.stages * microbatches)
    sync = bool(schedule.options.get("vertical_sync"))
    forwarded: list[int] = []  # with vertical sync, the forwards' keys in the order met
    forward, backward, weight, step = Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT, Kind.STEP
    versioned = {forward, backward, weight, step}
    for rank, lane in enumerate(schedule.ranks):
        steps: dict[int, int] = defaultdict(int)
        # in_use[stage][version]: forwards on that version whose backward is still to come
        # (plain dicts, not Counters: this runs for every action of a long window)
        in_use: dict[int, dict[int, int]] = defaultdict(dict)
        for index, action in enumerate(lane):
            kind = action[0]
            if kind not in versioned:  # transfers and collectives carry no version
                continue
            _, stage, mb, _, version = action
            key = stage * microbatches + (mb or 0)  # a pass's micro-batch is set; a STEP's not
            problem: str | None = None
            if kind is forward:
                if version is None or version > steps[stage]:
                    problem = (
                        f"{action} uses weight version {version}, but only "
                        f"{steps[stage]} updates have been applied"
                    )
                else:
                    forward_version[key] = version
                    if sync:
                        forwarded.append(key)
                    held = in_use[stage]
                    held[version] = held.get(version, 0) + 1
                    if len(held) + (steps[stage] not in held) > max_versions:
                        problem = _too_many(action, steps, in_use, max_versions)
            elif kind is step:
                steps[stage] += 1
                if version != steps[stage]:
                    problem = f"{action} should produce version {steps[stage]}"
                else:
                    held = in_use[stage]
                    if len(held) + (steps[stage] not in held) > max_versions:
                        problem = _too_many(action, steps, in_use, max_versions)
            else:  # a backward or a weight pass
                used = forward_version[key]
                if version != used:
                    problem = f"{action} uses version {version} but its forward used {used}"
                elif kind is backward and version is not None:
                    held = in_use[stage]
                    left = held.get(version, 0) - 1
                    if left:
                        held[version] = left
                    else:
                        held.pop(version, None)
            if problem is not None:
                raise ScheduleError(f"rank {rank}: {problem}", lane, rank, index)
    for key in forwarded:
        stage, mb = divmod(key, microbatches)
        if forward_version[key] != forward_version[mb]:
            raise ScheduleError(
                f"vertical sync: stage {stage} mini-batch {mb} uses version "
                f"{forward_version[key]}, stage 0 used {forward_version[mb]}"
            )


def _too_many(
    action: Action, steps: dict[int, int], in_use: dict[int, dict[int, int]], max_versions: float
) -> str:
    """The problem when the versions live on ``action``'s stage (those forwards still use,
    and the newest) are more than ``max_versions``."""
    stage = action[1]
    held = in_use[stage]
    live = len(held) + (steps[stage] not in held)
    return f"stage {stage} needs {live} weight versions at {action}, at most {max_versions} allowed"
