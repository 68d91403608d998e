"""What a checkpoint saves of one rank and restores into it: a :class:`TrainingState` value.

The training side hands this value over (``Pipeline.training_state()``), so the checkpoint
package knows nothing of the pipeline's class: only modules, an optimizer, a scheduler, a
loss scaler, the layout and the update cycle's counters.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.schedules import Schedule


class UpdateCounters(Protocol):
    """The update cycle's state that a checkpoint keeps."""

    def progress(self) -> tuple[int, int]:
        """The updates applied and skipped; raises when the state cannot be saved now
        (gradients waiting for an update, weight versions in flight)."""
        ...

    def restore(self, progress: tuple[int, int] | None) -> None:
        """After the weights were loaded: take the counters (``None``: keep them), make the
        loaded weights the only version, and clear the gradients."""
        ...


class StateDict(Protocol):
    """Anything with a ``state_dict`` to save and restore, such as a loss scaler."""

    def state_dict(self) -> dict[str, Any]:
        """The state to save."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved state."""
        ...


@dataclass(frozen=True)
class TrainingState:
    """One rank's training state: its stage ``modules`` (parameters and buffers named as in
    the full model), ``optimizer``, ``lr_scheduler`` and ``loss_scaler`` (each ``None``
    where there is none), the ``schedule`` and ``balance`` that laid it out, the update
    ``cycle``'s counters, and the process ``group`` and ``rank`` in it that save and load
    together."""

    modules: Mapping[int, nn.Module]
    optimizer: torch.optim.Optimizer | None
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None
    loss_scaler: StateDict | None
    schedule: Schedule
    balance: Sequence[int]
    cycle: UpdateCounters
    group: dist.ProcessGroup | None
    rank: int

    @property
    def layout(self) -> dict[str, Any]:
        """How the saving pipeline was laid out, kept with a checkpoint for messages."""
        return {
            "schedule": self.schedule.name,
            "asynchronous": self.schedule.asynchronous,
            "balance": list(self.balance),
            "stage_ranks": [list(ranks) for ranks in self.schedule.stage_ranks],
            "microbatches": self.schedule.microbatches,
        }

    def held(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers by full-model name (sharing their storage)."""
        held: dict[str, torch.Tensor] = {}
        for module in self.modules.values():
            held.update(module.state_dict())
        return held

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters by full-model name."""
        for module in self.modules.values():
            yield from module.named_parameters()

    def parameter_names(self) -> dict[int, str]:
        """Each parameter's full-model name, by the parameter's ``id``."""
        return {id(parameter): name for name, parameter in self.named_parameters()}


class HasTrainingState(Protocol):
    """What gives its training state, such as a :class:`~pipetrain.Pipeline`."""

    def training_state(self) -> TrainingState:
        """This rank's training state."""
        ...


def state_of(source: TrainingState | HasTrainingState) -> TrainingState:
    """``source`` itself, or the training state it gives."""
    return source if isinstance(source, TrainingState) else source.training_state()
