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

import re
from collections.abc import Sequence
from operator import itemgetter

from pipetrain.schedules.actions import COMPUTE_KINDS, Action, Kind
from pipetrain.schedules.errors import ScheduleError

# A lane as one letter per action, so that its pairs are found by patterns that run in C:
# F, B and W for compute, O for a marker, "." for anything else.
_LETTER = {
    kind: "O" if kind is Kind.OVERLAP else kind.value if kind in COMPUTE_KINDS else "."
    for kind in Kind
}
_PAIR = re.compile(r"O[^FBWO]*(F)[^FBWO]*B")  # a marker, its first compute F, its second B
_MARKED = re.compile(r"O[^FBW]*")  # markers and what follows them up to the next compute
_KIND = itemgetter(0)


def _letters(lane: Sequence[Action]) -> str | None:
    """``lane`` as letters, or ``None`` if it has no marker (most lanes)."""
    kinds = list(map(_KIND, lane))
    if Kind.OVERLAP not in kinds:
        return None
    return "".join(map(_LETTER.__getitem__, kinds))


def pairs(lane: Sequence[Action]) -> dict[int, int]:
    """For each overlapped pair in ``lane``, the index of its backward -> that of its
    forward (pairs that break the rule are left out; :func:`check_pairs` names them)."""
    letters = _letters(lane)
    if letters is None:
        return {}
    return {found.end() - 1: found.start(1) for found in _PAIR.finditer(letters)}


def check_pairs(lanes: Sequence[Sequence[Action]]) -> tuple[dict[int, int], ...]:
    """Raise :class:`ScheduleError` unless every ``OVERLAP`` is followed by a forward of its
    stage and then a backward, among the rank's compute actions; else each lane's
    :func:`pairs`."""
    checked: list[dict[int, int]] = []
    for rank, lane in enumerate(lanes):
        letters = _letters(lane)
        if letters is None:
            checked.append({})
            continue
        found_pairs = list(_PAIR.finditer(letters))
        checked.append({found.end() - 1: found.start(1) for found in found_pairs})
        # the usual lane: every marker starts a pair of its own, so only stages are left
        if len(found_pairs) == letters.count("O") and all(
            lane[found.start()][1] == lane[found.start(1)][1] for found in found_pairs
        ):
            continue
        forwards = {found.start(1) for found in found_pairs}
        for run in _MARKED.finditer(letters):
            forward = run.end()  # the first compute action after each marker of the run
            marker = run.start()
            while marker >= 0:
                if forward not in forwards or lane[forward].stage != lane[marker].stage:
                    raise ScheduleError(
                        f"rank {rank}: {lane[marker]} must be followed by a forward of stage "
                        f"{lane[marker].stage} and then a backward",
                        lane,
                        rank,
                        marker,
                    )
                marker = letters.find("O", marker + 1, forward)
    return tuple(checked)
