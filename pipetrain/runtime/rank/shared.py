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

import itertools
from collections.abc import Callable, Collection, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.model.frontend import SharedParameter
from pipetrain.runtime.rank.shard import local
from pipetrain.schedules import Schedule


class SharedGradients:
    """Sums each shared parameter's gradient over the ranks holding it (:meth:`reduce`)."""

    def __init__(
        self,
        shared: Sequence[SharedParameter],
        schedule: Schedule,
        modules: Mapping[int, nn.Module],
        global_rank: Callable[[int], int],
        rank: int,
        sharded: bool = False,
    ) -> None:
        """Make the process groups of each shared parameter's ranks. Every rank must call
        it with the same ``shared``: torch.distributed needs every rank to create every
        group, in the same order. ``rank`` is this rank of the pipeline's group. With
        ``sharded``, the holder stages' replicas will hold shards: each sums with the same
        replica of every other holder stage, which holds the same rows."""
        self._modules = modules
        # (stage, name, share, group, whether the stage is the parameter's first holder)
        self._entries: list[tuple[int, str, float, dist.ProcessGroup, bool]] = []
        self._copies: list[tuple[int, str, dist.ProcessGroup, int]] = []  # to synchronize
        for item in shared:
            holders = [schedule.stage_ranks[s] for s in item.stages]
            ranks = sorted({r for replicas in holders for r in replicas})
            if len(ranks) < 2:
                continue
            whole = dist.new_group([global_rank(r) for r in ranks])
            held = [s for s in item.stages if s in modules]
            sums = self._shard_groups(holders, global_rank) if sharded else None
            if not held:
                continue
            stage, name = held[0], item.names[held[0]]
            first = stage == item.stages[0]
            self._copies.append((stage, name, whole, global_rank(ranks[0])))
            if sums is None:
                share = 1.0 / len(schedule.stage_ranks[stage])
                self._entries.append((stage, name, share, whole, first))
            else:  # a shard holds the sum over its stage's replicas already
                replica = schedule.stage_ranks[stage].index(rank)
                self._entries.append((stage, name, 1.0, sums[replica], first))
        self.names = [item.names[item.stages[0]] for item in shared]

    @staticmethod
    def _shard_groups(
        holders: Sequence[Sequence[int]], global_rank: Callable[[int], int]
    ) -> list[dist.ProcessGroup]:
        """For each replica index, the group of that replica of every holder stage."""
        counts = {len(replicas) for replicas in holders}
        if len(counts) != 1:
            raise ValueError(
                "a parameter several stages use needs as many replicas on each of them to be "
                f"sharded, not {sorted(counts)}; give data_parallel=N for every stage"
            )
        return [
            dist.new_group([global_rank(replicas[d]) for replicas in holders])
            for d in range(counts.pop())
        ]

    def _parameter(self, stage: int, name: str) -> torch.Tensor:
        """The holder's parameter now (sharding replaces a module's parameters)."""
        return dict(self._modules[stage].named_parameters(remove_duplicate=False))[name]

    def synchronize(self) -> None:
        """Make every copy equal to its first holder's (after building: the stages may have
        been initialized on their own ranks), before any sharding."""
        with torch.no_grad():
            for stage, name, group, source in self._copies:
                dist.broadcast(self._parameter(stage, name), src=source, group=group)

    def reduce(self, stage: int | None = None) -> None:
        """Sum the holders' gradients into every copy (a missing gradient counts as zero):
        of every shared parameter on this rank, or of those ``stage`` holds."""
        for held, name, share, group, _ in self._entries:
            if stage is not None and held != stage:
                continue
            parameter = self._parameter(held, name)
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            grad = local(parameter.grad)
            if share != 1.0:
                grad.mul_(share)
            dist.all_reduce(grad, group=group)

    def count_once(self) -> None:
        """Before more gradients are added to summed ones (a clip summed them before the
        update): keep each sum on the parameter's first holder stage only, so that the next
        :meth:`reduce` counts it once."""
        for held, name, _, _, first in self._entries:
            grad = self._parameter(held, name).grad
            if not first and grad is not None:
                grad.zero_()


def check_sharing(shared: Sequence[SharedParameter], schedule: Schedule) -> None:
    """Raise ValueError (on every rank alike) where ``schedule`` cannot keep the ``shared``
    parameters one: an asynchronous schedule with replicated stages, or replicas of two
    stages on one rank that both hold such a parameter (each stage's replicas all-reduce
    its own gradients, which would sum that one tensor's twice)."""
    if not shared:
        return
    names = [item.names[item.stages[0]] for item in shared][:3]
    if schedule.asynchronous and any(len(r) > 1 for r in schedule.stage_ranks):
        raise ValueError(
            f"parameters {names} are used by several stages, which {schedule.name} cannot "
            "keep equal with replicated stages; use a synchronous schedule, no replicas, "
            "or a cut with one stage holding them"
        )
    for item in shared:
        for first, stage in itertools.combinations(item.stages, 2):
            together = set(schedule.stage_ranks[first]) & set(schedule.stage_ranks[stage])
            if together and len(schedule.stage_ranks[first]) > 1:
                raise ValueError(
                    f"parameter {item.names[first]!r} is used by stages {first} and {stage}, "
                    f"both on rank {min(together)} and replicated: their replicas cannot "
                    f"all-reduce one tensor for two stages under {schedule.name}; use a "
                    "schedule that puts those stages on different ranks (1f1b, interleaved), "
                    "or no data parallelism"
                )


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
