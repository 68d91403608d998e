"""Tensor-parallel stages of a captured model: Megatron's operators written into its graph.

A captured stage's planned linear layers keep their parameters as DTensors over the
mirrors' mesh (a colwise weight and bias ``Shard(0)``, a rowwise weight ``Shard(1)`` and its
bias ``Replicate``), so the optimizer, the gradient norm and checkpoints treat them as they
treat a stage given as layers. The graph itself computes on plain tensors: each use of such
a parameter goes through ``to_local()`` (whose backward gives the DTensor gradient), and two
operators make the sums explicit: before a colwise layer, :class:`CopyToRegion` (identity
forward, the gradient all-reduced over the mirrors backward), after a rowwise one,
:class:`ReduceFromRegion` (the partial outputs all-reduced forward, identity backward), its
bias added once after the sum. No DTensor operation runs inside the graph, so the only
collectives are these, in the same order on every mirror.

The rewrite of each graph is :class:`~pipetrain.runtime.rank.tensor_parallel_regions.GraphPass`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import fx, nn

from pipetrain.model.graph import GraphStage
from pipetrain.runtime.rank.tensor_parallel_regions import COPY, REDUCE, GraphPass

if TYPE_CHECKING:  # DTensor takes seconds to import: a run that splits stages imports it
    from torch.distributed.device_mesh import DeviceMesh


class CopyToRegion(torch.autograd.Function):
    """Identity forward; backward, the gradient summed over the mirrors (the input of a
    colwise layer: each mirror's part of the layer gives part of its gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromRegion(torch.autograd.Function):
    """The mirrors' partial outputs of a rowwise layer summed forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Operator(nn.Module):
    """One of the two operators as a module a graph calls (it holds the mirrors' group)."""

    def __init__(self, function: type[torch.autograd.Function], group: dist.ProcessGroup):
        super().__init__()
        self.function, self.group = function, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.function.apply(x, self.group)
        return out


def captured_plan(model: nn.Module, given: Mapping[str, str], degree: int) -> dict[str, str]:
    """The plan of a captured Hugging Face model (full-model module names or ``*`` patterns
    to styles): its config's ``base_model_tp_plan`` (names below its base model) with
    ``given`` on top, for :func:`~pipetrain.runtime.rank.tensor_parallel.model_plan` to
    check. ValueError names a head count ``degree`` does not divide."""
    config = getattr(model, "config", None)
    found = dict(getattr(config, "base_model_tp_plan", None) or {})
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        found = {f"{prefix}.{name}": style for name, style in found.items()}
    if set(found) - set(given):  # the config's own plan splits its attention heads
        for count in ("num_attention_heads", "num_key_value_heads"):
            heads = getattr(config, count, None)
            if isinstance(heads, int) and heads % degree:
                raise ValueError(
                    f"tensor_parallel={degree} splits the model's attention heads, and its "
                    f"{count}={heads} does not divide by {degree}; give a tensor_parallel "
                    f"that divides {heads}"
                )
    return {**found, **given}


def distribute_graph_stage(
    stage: GraphStage, plan: Mapping[str, str], group: dist.ProcessGroup, mesh: DeviceMesh
) -> GraphStage:
    """Split ``stage``'s linear layers named in ``plan`` over ``mesh`` (the mirrors, whose
    group is ``group``) after giving every mirror the first one's weights, and rewrite its
    graph (and its eval-mode graphs) to compute on each mirror's part."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    source = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in [*stage.parameters(), *stage.buffers()]:
            dist.broadcast(tensor, src=source, group=group)
    names = dict(stage.named_modules())
    held = {name: style for name, style in plan.items() if name in names}
    for name, style in held.items():
        module = names[name]
        for leaf, parameter in list(module._parameters.items()):
            if parameter is None:
                continue
            split = 0 if style == "colwise" else 1 if leaf == "weight" else None
            placement = Replicate() if split is None else Shard(split)
            module._parameters[leaf] = nn.Parameter(
                distribute_tensor(parameter.detach(), mesh, [placement]),
                requires_grad=parameter.requires_grad,
            )
    degree = dist.get_world_size(group)

    def rewrite(graph: fx.Graph, owner: GraphStage) -> None:
        owner.add_module(COPY, _Operator(CopyToRegion, group))
        owner.add_module(REDUCE, _Operator(ReduceFromRegion, group))
        tensors = {
            **dict(owner.named_buffers(remove_duplicate=False)),
            **dict(owner.named_parameters(remove_duplicate=False)),
        }
        for node in graph.nodes:  # the shapes of the tensors read from the stage
            if node.op == "get_attr" and "val" not in node.meta:
                node.meta["val"] = tensors.get(str(node.target))
        GraphPass(graph, held, degree).run()

    stage.rewrite(rewrite)
    return stage
