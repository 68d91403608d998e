"""Sharded replicas: a replicated stage whose replicas each hold a shard of its parameters,
gradients and optimizer state (ZeRO-3, with torch's FSDP2 ``fully_shard``).

With ``PipelineConfig(shard=True)`` every replicated stage's module is wrapped by
:func:`torch.distributed.fsdp.fully_shard` over a device mesh of its replicas' ranks
(:func:`shard_stage`): its parameters become sharded ``DTensor``\\ s, the schedule's
``GATHER`` of the stage (:mod:`pipetrain.schedules.gathers`) all-gathers them before the
step's first pass and they stay gathered through its passes, and the optimizer steps only
this rank's shard. The micro-batches' backwards accumulate their gradients unreduced; the
schedule's ``ALLREDUCE`` of the stage, after its update's last backward, then
reduce-scatters them once and frees the gathered parameters (:class:`ShardedReducer`, in
place of the replicated stage's all-reduce), summed over the replicas as replicated stages'
gradients are, since each replica's micro-batch losses are already weighted by their share
of the whole mini-batch.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:  # FSDP takes seconds to import: a run that shards imports it
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule


def shard_stage(
    module: nn.Module,
    group: dist.ProcessGroup,
    device: torch.device,
    mesh: DeviceMesh | None = None,
) -> FSDPModule:
    """Wrap ``module`` (a stage's, on every rank of its replica ``group``) so that each replica
    holds a shard of its parameters; gradients wait unreduced until :class:`ShardedReducer`
    reduces them. Every replica must hold the same initial weights. ``mesh``: the replicas'
    dimension of a mesh whose other dimension splits the stage's parameters already
    (tensor parallelism; by default a mesh of ``group``)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = mesh or DeviceMesh.from_group(group, device.type)
    # gathered by the schedule's GATHER, freed at the reduce-scatter: not between passes
    sharded: FSDPModule = fully_shard(module, mesh=mesh, reshard_after_forward=False)
    sharded.set_gradient_divide_factor(1.0)  # replicas' weighted losses sum, as all-reduces do
    sharded.set_force_sum_reduction_for_comms(True)  # a plain sum: gloo has no scaled one
    sharded.set_requires_gradient_sync(False)
    sharded.set_reshard_after_backward(False)
    return sharded


class ShardedReducer:
    """Reduce-scatters a sharded stage's accumulated gradients at the stage's ``ALLREDUCE``;
    the interface of :class:`~pipetrain.runtime.rank.reduce.GradientReducer`."""

    def __init__(self, module: FSDPModule) -> None:
        """Reduce the gradients that ``module``'s backwards accumulated."""
        self.module = module

    def gather(self) -> None:
        """All-gather the stage's parameters (the schedule's ``GATHER``); they stay gathered
        until :meth:`finish` (or through calls that only accumulate)."""
        self.module.unshard()

    def arm(self, tensors: Sequence[torch.Tensor]) -> None:
        """Nothing to start early: the gradients are reduced once, at :meth:`finish`."""

    def finish(self, unarmed: Sequence[torch.Tensor]) -> None:
        """Reduce-scatter every gradient accumulated since the last call into this rank's
        shard (``param.grad``), then free the gathered parameters; a replica that ran no
        micro-batch contributes zeros."""
        from torch.distributed.fsdp import fully_shard

        module = self.module
        module.set_is_last_backward(True)
        module.set_reshard_after_backward(True)
        module.set_requires_gradient_sync(True)
        state = fully_shard.state(module)  # type: ignore[attr-defined]
        for inner in state._state_ctx.all_states:
            for group in inner._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()
        module.set_requires_gradient_sync(False)
        module.set_reshard_after_backward(False)
        module.reshard()
        for tensor in unarmed:
            if tensor.requires_grad and tensor.grad is None:
                tensor.grad = torch.zeros_like(tensor)

    def count_once(self, tensors: Sequence[torch.Tensor]) -> None:
        """Nothing to do: the next reduce-scatter adds to the shard this rank holds."""


def gathered(module: nn.Module) -> list[torch.Tensor] | None:
    """The gathered parameters a sharded stage's forwards ran on, the leaves of their graphs
    (a split backward's weight pass accumulates its gradients there, for the reduce-scatter);
    ``None`` for a stage that is not sharded."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None or not isinstance(module, fsdp.FSDPModule):
        return None
    state = fsdp.fully_shard.state(module)
    return [
        param.unsharded_param
        for inner in state._state_ctx.all_states
        for group in inner._fsdp_param_groups
        for param in group.fsdp_params
        if param.unsharded_param.requires_grad
    ]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: its shard of a ``DTensor``, or the tensor itself."""
    # no DTensor exists before its module is imported, and importing it costs seconds
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(tensor, dtensor.DTensor):
        return tensor.to_local()
    return tensor
