"""Parameters that several stages use (tied embeddings) stay one parameter.

Each stage holding such a parameter keeps its own copy and computes its part of the
gradient; before every synchronous update the holders' ranks sum those parts, so every
copy takes the same update and stays bit-identical. An asynchronous stage sums its part of
update ``k`` with the other holders' parts of their update ``k`` before applying it, so
it waits for the slowest holder to reach that update. A replicated holder's replicas already
hold the same (summed) gradient, so each adds its share ``1 / replicas``. On a rank
holding two of the stages the copies are one tensor, whose gradient already adds both.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.model.frontend import SharedParameter
from pipetrain.schedules import Schedule


class SharedGradients:
    """Sums each shared parameter's gradient over the ranks holding it (:meth:`reduce`)."""

    def __init__(
        self,
        shared: Sequence[SharedParameter],
        schedule: Schedule,
        modules: Mapping[int, nn.Module],
        global_rank: Callable[[int], int],
    ) -> None:
        """Make the process group of each shared parameter's ranks. Every rank must call
        it with the same ``shared``: torch.distributed needs every rank to create every
        group, in the same order."""
        self._entries: list[tuple[int, nn.Parameter, float, dist.ProcessGroup]] = []
        self._sources: list[int] = []  # each entry's first holder, by the world's rank
        for item in shared:
            ranks = sorted({r for s in item.stages for r in schedule.stage_ranks[s]})
            if len(ranks) < 2:
                continue
            group = dist.new_group([global_rank(r) for r in ranks])
            held = [s for s in item.stages if s in modules]
            if not held:
                continue
            parameters = dict(modules[held[0]].named_parameters(remove_duplicate=False))
            share = 1.0 / len(schedule.stage_ranks[held[0]])
            self._entries.append((held[0], parameters[item.names[held[0]]], share, group))
            self._sources.append(global_rank(ranks[0]))
        self.names = [item.names[item.stages[0]] for item in shared]

    def synchronize(self) -> None:
        """Make every copy equal to its first holder's (after building: the stages may have
        been initialized on their own ranks)."""
        with torch.no_grad():
            for (_, parameter, _, group), source in zip(self._entries, self._sources):
                dist.broadcast(parameter, src=source, group=group)

    def reduce(self, stage: int | None = None) -> None:
        """Sum the holders' gradients into every copy (a missing gradient counts as zero):
        of every shared parameter on this rank, or of those ``stage`` holds."""
        for held, parameter, share, group in self._entries:
            if stage is not None and held != stage:
                continue
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            if share != 1.0:
                parameter.grad.mul_(share)
            dist.all_reduce(parameter.grad, group=group)


def counted_once(
    modules: Mapping[int, nn.Module],
    schedule: Schedule,
    rank: int,
    shared: Sequence[SharedParameter],
    sharded: Collection[int] = (),
) -> list[nn.Parameter]:
    """This rank's parameters that enter the global gradient norm: a replicated stage's
    from its first replica (every replica's shard of a ``sharded`` stage), a shared
    parameter from its first holder stage, each once."""
    elsewhere = {(s, item.names[s]) for item in shared for s in item.stages[1:]}
    counted: dict[int, nn.Parameter] = {}
    for stage, module in modules.items():
        if schedule.stage_ranks[stage][0] != rank and stage not in sharded:
            continue
        for name, parameter in module.named_parameters():
            if parameter.requires_grad and (stage, name) not in elsewhere:
                counted.setdefault(id(parameter), parameter)
    return list(counted.values())
