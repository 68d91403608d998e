"""Record the measured start and end of every action into :class:`~pipetrain.timeline.Event` s."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from pipetrain.timeline import Event, Timeline


class Recorder:
    """Collects one rank's events, timed by the wall clock.

    Every process on a host reads the same wall clock, so the ranks' events line up
    without any exchange (across hosts, as well as the hosts' clocks agree). On CUDA the
    clock reads wait for the device, so events measure the work, not its launch; a
    disabled recorder does neither.
    """

    def __init__(
        self, rank: int, device: torch.device, enabled: bool = True, mirrors: int = 1
    ) -> None:
        """Record for ``rank``; synchronize ``device`` around events if it is a GPU.
        ``mirrors``: the processes playing each rank (tensor parallelism), whose first
        alone speaks for the rank in a gathered timeline."""
        self.rank, self.mirrors = rank, mirrors
        self.enabled = enabled
        self._sync = device.type == "cuda"
        self.events: list[Event] = []

    def reset(self) -> None:
        """Forget recorded events."""
        self.events = []

    def now(self) -> float:
        """Seconds since the epoch."""
        if self._sync:
            torch.cuda.synchronize()
        return time.time()

    def add(
        self, kind: str, stage: int | None, microbatch: int | None, start: float, end: float
    ) -> None:
        """Append one event."""
        self.events.append(Event(self.rank, kind, stage, microbatch, start, end))

    def gather(self, group: dist.ProcessGroup | None, root: int, label: str) -> Timeline | None:
        """Every rank's events gathered on global rank ``root`` as a timeline starting at 0
        (``None`` on the other ranks). Every rank of ``group`` must call it."""
        world = dist.get_world_size(group)
        gathered: list[list[Event]] | None = (
            [[] for _ in range(world)] if dist.get_rank() == root else None
        )
        first = dist.get_rank(group) % self.mirrors == 0
        dist.gather_object(self.events if first else [], gathered, dst=root, group=group)
        if gathered is None:
            return None
        events = [event for events in gathered for event in events]
        return Timeline(events, world // self.mirrors, label=label).shifted()
