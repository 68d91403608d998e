"""All-reduce a replicated stage's weight gradients in buckets, overlapped with its backward.

A stage's parameters are grouped into buckets in reverse order, the order in which a
backward produces their gradients. Before the stage's last backward of an update the
reducer is armed: a hook on every parameter notes when its gradient is complete, and a
bucket whose gradients are all complete starts its all-reduce at once, while the backward
goes on with the earlier layers. The all-reduce action then only starts what is left
(parameters that got no gradient), waits, and writes the results back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from pipetrain.runtime.rank.shard import local
from pipetrain.schedules import Action, Kind, Schedule

DEFAULT_BUCKET_BYTES = 4 << 20


def buckets_of(parameters: Sequence[torch.Tensor], bucket_bytes: float) -> list[list[int]]:
    """Parameter indices in buckets of at most ``bucket_bytes`` (a larger parameter gets a
    bucket of its own), taken from the last parameter to the first."""
    buckets: list[list[int]] = []
    size = 0
    for index in reversed(range(len(parameters))):
        nbytes = parameters[index].numel() * parameters[index].element_size()
        if not buckets or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(index)
        size += nbytes
    return buckets


def completing_passes(
    lane: Sequence[Action], stages: Collection[int], split_backward: bool
) -> set[tuple[int, int]]:
    """``(stage, micro-batch)`` of the passes in ``lane`` that complete the weight gradients
    of an update of one of ``stages``: each stage's last backward (or weight pass, when the
    backward is split) before each of its all-reduces. The reducer is armed before them."""
    gradient_kind = Kind.WEIGHT if split_backward else Kind.BACKWARD
    last: dict[int, int] = {}
    found = set()
    for action in lane:
        if (
            action.kind is gradient_kind
            and action.stage in stages
            and action.microbatch is not None
        ):
            last[action.stage] = action.microbatch
        elif action.kind is Kind.ALLREDUCE and action.stage in last:
            found.add((action.stage, last.pop(action.stage)))
    return found


class Reducer(Protocol):
    """What a replicated stage's gradients are reduced by: armed before the update's last
    gradient pass, finished at the stage's ``ALLREDUCE``; ``gather`` at its ``GATHER``."""

    def gather(self) -> None:
        """Make the stage's whole parameters present for the step's passes."""
        ...

    def arm(self, tensors: Sequence[torch.Tensor]) -> None:
        """Prepare for the update's last backward, which fills ``tensors``' gradients."""
        ...

    def finish(self, unarmed: Sequence[torch.Tensor]) -> None:
        """Reduce the gradients (of ``unarmed``'s tensors when nothing was armed)."""
        ...

    def count_once(self, tensors: Sequence[torch.Tensor]) -> None:
        """Before more gradients are added to reduced ones (``tensors``'): leave the next
        reduction to count the reduced ones once."""
        ...


class GradientReducer:
    """Sums (or averages) one stage's weight gradients over its replicas' process group."""

    def __init__(
        self,
        parameters: Sequence[torch.Tensor],
        group: dist.ProcessGroup | None,
        replicas: int,
        average: bool,
        bucket_bytes: float = DEFAULT_BUCKET_BYTES,
    ) -> None:
        """Reduce ``parameters``' gradients over ``group`` (``replicas`` ranks; ``None``: the
        default group); ``average`` divides the sum by ``replicas``."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes!r}")
        self.group, self.replicas, self.average = group, replicas, average
        self.buckets = buckets_of(parameters, bucket_bytes)
        self._bucket_of = {index: b for b, bucket in enumerate(self.buckets) for index in bucket}
        self._reset()

    def gather(self) -> None:
        """Nothing to gather: every replica holds the whole stage."""

    def _reset(self) -> None:
        self._tensors: Sequence[torch.Tensor] = ()
        self._hooks: list[RemovableHandle] = []
        self._waiting = [len(bucket) for bucket in self.buckets]
        self._pending: list[tuple[torch.Tensor, dist.Work]] = []  # started buckets, in bucket order

    def arm(self, tensors: Sequence[torch.Tensor]) -> None:
        """Start each bucket's all-reduce as soon as the coming backward completes its
        gradients. ``tensors`` receive the gradients, in the order of the parameters given
        at construction: the parameters themselves, or a stashed weight version of them.
        Their gradients must be final after that backward: it is the update's last one."""
        self._remove_hooks()
        self._reset()
        self._tensors = tensors
        for index, tensor in enumerate(tensors):
            if tensor.requires_grad:
                self._hooks.append(
                    tensor.register_post_accumulate_grad_hook(
                        lambda _, index=index: self._ready(index)
                    )
                )

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _ready(self, index: int) -> None:
        self._waiting[self._bucket_of[index]] -= 1
        # buckets start in bucket order on every replica, so that their collectives pair up
        while len(self._pending) < len(self.buckets) and self._waiting[len(self._pending)] == 0:
            self._launch(len(self._pending))

    def _launch(self, bucket: int) -> None:
        grads = [self._grad(index) for index in self.buckets[bucket]]
        flat = torch._utils._flatten_dense_tensors(grads)
        self._pending.append((flat, dist.all_reduce(flat, group=self.group, async_op=True)))

    def _grad(self, index: int) -> torch.Tensor:
        tensor = self._tensors[index]
        if tensor.grad is None:
            tensor.grad = torch.zeros_like(tensor)
        return local(tensor.grad)  # a tensor-parallel shard sums with the same shards

    @property
    def started(self) -> int:
        """How many buckets' all-reduces have started since the last :meth:`finish`."""
        return len(self._pending)

    @property
    def armed(self) -> bool:
        """Whether a backward has been armed since the last :meth:`finish`."""
        return bool(self._tensors)

    def finish(self, unarmed: Sequence[torch.Tensor]) -> None:
        """Start every bucket not yet started, wait for all, and write the results into the
        gradients of the armed tensors, or of ``unarmed`` when no backward was armed (a
        replica that ran no micro-batch contributes zeros)."""
        self._remove_hooks()
        if not self.armed:
            self._tensors = unarmed
        for bucket in range(len(self._pending), len(self.buckets)):
            self._launch(bucket)
        for bucket, (flat, work) in enumerate(self._pending):
            work.wait()
            if self.average:
                flat /= self.replicas
            grads = [self._grad(index) for index in self.buckets[bucket]]
            for grad, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                grad.copy_(reduced)
        self._reset()

    def count_once(self, tensors: Sequence[torch.Tensor]) -> None:
        """Before more gradients are added to reduced ones (``tensors``'): keep the reduced
        sum on the first replica only, so that the next sum counts it once (an average of
        equal parts is already that part)."""
        if self.average or dist.get_rank(self.group) == 0:
            return
        for tensor in tensors:
            if tensor.grad is not None:
                tensor.grad.zero_()


def replica_groups(
    schedule: Schedule, global_rank: Callable[[int], int]
) -> dict[int, dist.ProcessGroup]:
    """A process group of each replicated stage's replicas that the schedule all-reduces (by
    stage; ``global_rank`` maps a rank of the pipeline's group to the world's). Every rank
    must call it: torch.distributed needs every rank to create every group, in order."""
    reduced = {a.stage for lane in schedule.ranks for a in lane if a.kind is Kind.ALLREDUCE}
    return {
        stage: dist.new_group([global_rank(r) for r in ranks])
        for stage, ranks in enumerate(schedule.stage_ranks)
        if len(ranks) > 1 and stage in reduced
    }


def replica_reducers(
    modules: Mapping[int, nn.Module],
    schedule: Schedule,
    groups: Mapping[int, dist.ProcessGroup],
    device: torch.device,
    bucket_bytes: float | None,
) -> dict[int, GradientReducer]:
    """A gradient reducer for each of ``modules`` (this rank's, by stage) that ``groups``
    holds its replicas' process group for. By default buckets are
    :data:`DEFAULT_BUCKET_BYTES` on GPUs and the whole stage on CPUs, where the all-reduce's
    thread would take cores from the computation it overlaps."""
    if bucket_bytes is None:
        bucket_bytes = DEFAULT_BUCKET_BYTES if device.type == "cuda" else math.inf
    # synchronous replicas sum: their micro-batches make one mini-batch whose losses are
    # already weighted by their share; asynchronous ones average, as data parallelism does
    return {
        stage: GradientReducer(
            [p for p in modules[stage].parameters() if p.requires_grad],
            group,
            len(schedule.stage_ranks[stage]),
            schedule.asynchronous,
            bucket_bytes,
        )
        for stage, group in groups.items()
        if stage in modules
    }
