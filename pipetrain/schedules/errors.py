"""Schedule errors that show where: the failing rank's actions, the culprit marked."""

from __future__ import annotations

from collections.abc import Sequence

from pipetrain.schedules.actions import Action

_CONTEXT = (8, 4)  # actions shown before and after the failing one


class ScheduleError(ValueError):
    """A schedule that cannot run correctly.

    The first line names the rank and action; where one action is at fault, the rank's
    action list follows with that action marked. ``rank`` and ``index`` locate it.
    """

    def __init__(
        self,
        message: str,
        lane: Sequence[Action] | None = None,
        rank: int | None = None,
        index: int | None = None,
    ) -> None:
        """``message``, then ``lane`` (rank ``rank``'s actions) listed, marked at ``index``."""
        if lane is not None and rank is not None and index is not None:
            message += "\n" + listing(lane, rank, index)
        super().__init__(message)
        self.rank, self.index = rank, index


def listing(lane: Sequence[Action], rank: int, index: int) -> str:
    """Rank ``rank``'s actions around ``index``, one a line, the one at ``index`` marked."""
    before, after = _CONTEXT
    start, stop = max(0, index - before), min(len(lane), index + after + 1)
    lines = [f"rank {rank}'s actions:"]
    if start:
        lines.append(f"  ... {start} earlier")
    for i in range(start, stop):
        lines.append(f"  {i:>6}  {lane[i]}" + ("   <-- here" if i == index else ""))
    if stop < len(lane):
        lines.append(f"  ... {len(lane) - stop} later")
    return "\n".join(lines)
