"""Re-materialization: run a stage forward without keeping its inside, recompute it later.

The random-number state is saved before the first run and restored for the recompute, so
dropout and other randomness give the same result both times. Buffers that a forward
updates in place (batch normalization's running statistics and its count of batches, or
any other) are written by the first run only: the recompute's writes are undone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
from torch import nn

from pipetrain.schedules import RECOMPUTE_MODES

T = TypeVar("T")


def check_mode(mode: str) -> str:
    """Return ``mode`` if it is a recompute mode, else raise a ValueError listing them."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {mode!r}")
    return mode


def recomputes(mode: str, microbatch: int, microbatches: int) -> bool:
    """Whether ``microbatch`` is recomputed: ``except_last`` keeps the last one, whose
    backward follows its forward at once."""
    return mode == "always" or (mode == "except_last" and microbatch != microbatches - 1)


class RandomState:
    """The CPU and (if used) CUDA generator states at one moment."""

    def __init__(self, device: torch.device) -> None:
        """Capture the states that a forward on ``device`` may consume."""
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @contextmanager
    def restored(self) -> Iterator[None]:
        """Run the body with the captured states; the caller's states are kept outside it."""
        devices = [self.device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


def recompute(run: Callable[[], T], state: RandomState, module: nn.Module) -> T:
    """Run ``run`` again with gradients on, under the random state of its first run,
    leaving ``module``'s buffers as they were before."""
    buffers = list(module.buffers())
    saved = [b.clone() for b in buffers]
    with state.restored(), torch.enable_grad():
        result = run()
    for buffer, value in zip(buffers, saved):
        # through .data: the recompute's graph may have saved the buffer (batch norm saves
        # its running statistics), and putting the values back is no change it must refuse
        buffer.data.copy_(value)
    return result
