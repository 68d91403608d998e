"""Overlapped pairs: ``OVERLAP s`` written before a rank's forward ``F s.k`` and a backward
``B t.j`` says the two run together (DualPipeV overlaps one micro-batch's forward with
another's backward, so that the communication of each hides behind the other's compute).

The pair's B takes its inputs when the pair starts (lowering receives them before the F),
the simulator costs the two as one span (:class:`~pipetrain.simulation.Costs` says how much
of the shorter pass the longer hides), and the runtime runs the forward and then the
backward. :func:`pairs` finds each pair in a lane; :func:`check_pairs` is the validator's
rule: every ``OVERLAP`` is followed, among the rank's compute actions, by a forward of its
stage and then a backward.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.schedules.actions import COMPUTE_KINDS, Action, Kind
from pipetrain.schedules.errors import ScheduleError


def pairs(lane: Sequence[Action]) -> dict[int, int]:
    """For each overlapped pair in ``lane``, the index of its backward -> that of its
    forward (pairs that break the rule are left out; :func:`check_pairs` names them)."""
    found: dict[int, int] = {}
    forward: int | None = None
    waiting = False
    for index, action in enumerate(lane):
        kind = action.kind
        if kind is Kind.OVERLAP:
            waiting, forward = True, None
        elif waiting and kind in COMPUTE_KINDS:
            if forward is None and kind is Kind.FORWARD:
                forward = index
            else:
                if forward is not None and kind is Kind.BACKWARD:
                    found[index] = forward
                waiting, forward = False, None
    return found


def check_pairs(lanes: Sequence[Sequence[Action]]) -> None:
    """Raise :class:`ScheduleError` unless every ``OVERLAP`` is followed by a forward of its
    stage and then a backward, among the rank's compute actions."""
    for rank, lane in enumerate(lanes):
        markers = [index for index, action in enumerate(lane) if action.kind is Kind.OVERLAP]
        found = {forward: backward for backward, forward in pairs(lane).items()}
        for marker in markers:
            forward = next(
                (i for i in range(marker + 1, len(lane)) if lane[i].kind in COMPUTE_KINDS), None
            )
            if forward is None or forward not in found or lane[forward].stage != lane[marker].stage:
                raise ScheduleError(
                    f"rank {rank}: {lane[marker]} must be followed by a forward of stage "
                    f"{lane[marker].stage} and then a backward",
                    lane,
                    rank,
                    marker,
                )
