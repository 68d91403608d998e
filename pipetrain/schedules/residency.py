"""Stages resident on a rank: the rules of schedules whose weights live in a host store.

In such a schedule (``roundpipe``) a worker owns no stage between steps. ``LOAD s`` fetches
stage ``s``'s weights from the host store, and the stage stays resident on the rank until
``OFFLOAD s`` hands its weight gradients back (none when only forwards ran since the
``LOAD``) and frees it. The host sums what the ranks of a stage return and steps the
stage's optimizer once its last ``OFFLOAD`` has arrived, so the workers write no ``STEP``,
no ``ALLREDUCE`` (the host store does the reduction) and no ``GATHER``.

:func:`check_residency` enforces, on each rank: every ``F``/``B``/``W`` of a stage between a
``LOAD`` of it and the next ``OFFLOAD``; no ``LOAD`` of a stage already resident, no
``OFFLOAD`` of one that is not; nothing resident at the end of the lane (so each stage's
gradients are returned after its last pass there); and, where the schedule's facts state
``resident`` (the stages a rank may hold at once, 2 with a prefetch), no more than that.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter
from typing import TYPE_CHECKING

from pipetrain.schedules.actions import COMPUTE_KINDS, HOST_KINDS, Action, Kind
from pipetrain.schedules.errors import ScheduleError

if TYPE_CHECKING:
    from pipetrain.schedules.schedule import Schedule

_KIND = itemgetter(0)
_WORKER_UPDATES = frozenset({Kind.STEP, Kind.ALLREDUCE, Kind.GATHER})


def host_stored(lanes: Sequence[Sequence[Action]]) -> bool:
    """Whether ``lanes`` keep their weights in a host store: any ``LOAD`` or ``OFFLOAD``
    (read as :attr:`Schedule.host_stored`, found once per schedule)."""
    kinds: set[Kind] = set()
    for lane in lanes:
        kinds.update(map(_KIND, lane))  # in C: every schedule is asked
    return not HOST_KINDS.isdisjoint(kinds)


def stepping_offloads(lane: Sequence[Action]) -> dict[int, int]:
    """For each stage whose gradients ``lane`` returns, which of its ``OFFLOAD``s (counting
    from 1) is the last to carry gradients (a ``B`` or ``W`` of the stage ran since its
    ``LOAD``): where the stage's update may be made, the ``STEP`` the workers do not write."""
    offloads: dict[int, int] = {}
    carrying: set[int] = set()
    stepping: dict[int, int] = {}
    for action in lane:
        kind, stage = action.kind, action.stage
        if kind is Kind.LOAD:
            carrying.discard(stage)
        elif kind is Kind.BACKWARD or kind is Kind.WEIGHT:
            carrying.add(stage)
        elif kind is Kind.OFFLOAD:
            offloads[stage] = offloads.get(stage, 0) + 1
            if stage in carrying:
                stepping[stage] = offloads[stage]
    return stepping


def check_residency(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` where a host-stored schedule breaks a residency rule
    (see the module's description)."""
    cap = schedule.options.get("resident")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ScheduleError(
            f"the fact resident={cap!r} must be a positive count of stages a rank may hold"
        )
    for rank, lane in enumerate(schedule.ranks):
        _check_lane(rank, lane, cap)


def _check_lane(rank: int, lane: tuple[Action, ...], cap: int | None) -> None:
    resident: dict[int, int] = {}  # stage -> index of the LOAD that made it resident
    offloaded: set[int] = set()
    for index, action in enumerate(lane):
        kind, stage = action.kind, action.stage
        if kind is Kind.LOAD:
            if stage in resident:
                raise _refused(
                    rank,
                    lane,
                    index,
                    f"loads stage {stage}, resident already since the LOAD at index "
                    f"{resident[stage]}: write OFFLOAD{stage} between them, or drop this LOAD",
                )
            resident[stage] = index
            if cap is not None and len(resident) > cap:
                held = ", ".join(map(str, resident))
                raise _refused(
                    rank,
                    lane,
                    index,
                    f"makes {len(resident)} stages resident at once ({held}), more than the "
                    f"schedule's resident={cap}: OFFLOAD one of them before this LOAD",
                )
        elif kind is Kind.OFFLOAD:
            if resident.pop(stage, None) is None:
                raise _refused(
                    rank,
                    lane,
                    index,
                    f"returns stage {stage}, which is not resident: write LOAD{stage} "
                    "before its passes and one OFFLOAD after them",
                )
            offloaded.add(stage)
        elif kind in COMPUTE_KINDS and stage not in resident:
            if stage in offloaded:
                raise _refused(
                    rank,
                    lane,
                    index,
                    f"runs after OFFLOAD{stage} returned stage {stage}'s gradients and freed "
                    f"it: move the pass before that OFFLOAD, or LOAD{stage} again before it",
                )
            raise _refused(
                rank,
                lane,
                index,
                f"runs before stage {stage}'s weights are loaded: write LOAD{stage} before "
                f"stage {stage}'s first pass on rank {rank}",
            )
        elif kind in _WORKER_UPDATES:
            raise _refused(
                rank,
                lane,
                index,
                "in a schedule whose weights live in the host store (it has LOAD and "
                f"OFFLOAD): the host sums stage {stage}'s gradients as they arrive with each "
                "OFFLOAD and steps its optimizer, so write no STEP, ALLREDUCE or GATHER",
            )
    if resident:
        stage, index = next(iter(resident.items()))
        raise ScheduleError(
            f"rank {rank}: stage {stage} is still resident at the end of the lane (loaded at "
            f"index {index}): write OFFLOAD{stage} after its last pass, so that its gradients "
            "reach the host store",
            lane,
            rank,
            index,
        )


def _refused(rank: int, lane: tuple[Action, ...], index: int, message: str) -> ScheduleError:
    """The error for ``lane[index]``, its rank's actions listed."""
    return ScheduleError(f"rank {rank}: {lane[index]} {message}", lane, rank, index)
