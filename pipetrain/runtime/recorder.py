"""Record the measured start and end of every action into :class:`~pipetrain.trace.Event` s."""

from __future__ import annotations

import time

import torch

from pipetrain.trace import Event


class Recorder:
    """Collects one rank's events; times are seconds since :meth:`reset`.

    On CUDA the clock reads wait for the device, so events measure the work, not its launch;
    a disabled recorder does neither.
    """

    def __init__(self, rank: int, device: torch.device, enabled: bool = True) -> None:
        """Record for ``rank``; synchronize ``device`` around events if it is a GPU."""
        self.rank = rank
        self.enabled = enabled
        self._sync = device.type == "cuda"
        self._origin = time.perf_counter()
        self.events: list[Event] = []

    def reset(self) -> None:
        """Forget recorded events and restart the clock (call after a barrier)."""
        self.events = []
        self._origin = time.perf_counter()

    def now(self) -> float:
        """Seconds since the origin."""
        if self._sync:
            torch.cuda.synchronize()
        return time.perf_counter() - self._origin

    def add(self, kind: str, stage: int | None, microbatch: int | None, start: float, end: float) -> None:
        """Append one event."""
        self.events.append(Event(self.rank, kind, stage, microbatch, start, end))
