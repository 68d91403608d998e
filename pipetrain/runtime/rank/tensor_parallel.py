"""Tensor-parallel stages: each stage's linear layers split over the processes that mirror a
rank (``PipelineConfig(tensor_parallel=T)``), with DTensor's ``parallelize_module``.

A plan names modules of the full model and how each is split: ``"colwise"`` (its output
features, :class:`~torch.distributed.tensor.parallel.ColwiseParallel`) or ``"rowwise"``
(its input features, :class:`~torch.distributed.tensor.parallel.RowwiseParallel`, whose
partial outputs are summed). It comes from the layers (a ``tensor_parallel_plan(degree)``
method on any module of a layer, giving paths below that module, as the built-in GPT's
blocks have) and from ``PipelineConfig.tensor_parallel_plan`` (full-model names, ``*``
patterns allowed), which adds to and overrides the layers'. Within a stage each colwise
module must be followed by a rowwise one, so that what leaves the stage is whole on every
process: a stage's boundary tensors are sent once per group of mirrors
(:mod:`pipetrain.distributed.mirrored`).

A parameter split over the mirrors is a ``DTensor`` sharded over them; one that is not split
(a layer norm, a rowwise bias) is replicated: the same on every mirror. The global gradient
norm counts each element once: the shards' squares on every mirror, a replicated
parameter's on the group's first process only (:func:`counted_by_mirror`). With
``shard=True`` a replicated stage's mesh has two dimensions, its replicas (``dp``) by its
mirrors (``tp``), and FSDP shards over ``dp`` what tensor parallelism left on each mirror.
"""

from __future__ import annotations

import fnmatch
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.model.frontend import FrontEnd, SharedParameter, shared_parameters
from pipetrain.model.graph import GraphModel, GraphStage
from pipetrain.model.layers import Layer, stage_bounds
from pipetrain.runtime.rank.reduce import replica_groups
from pipetrain.runtime.rank.shared import SharedGradients
from pipetrain.runtime.rank.tensor_parallel_graph import captured_plan, distribute_graph_stage
from pipetrain.schedules import Schedule

if TYPE_CHECKING:  # DTensor takes seconds to import: a run that splits stages imports it
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

STYLES = ("colwise", "rowwise")
_FIX = (
    "give PipelineConfig(tensor_parallel_plan={module name: 'colwise' or 'rowwise'}) naming "
    "pairs of nn.Linear modules (a colwise one, then a rowwise one), or a "
    "tensor_parallel_plan(degree) method on the layers"
)


def _modules(layers: Sequence[Layer]) -> dict[str, nn.Module]:
    """Every module of the model's layers by its full-model name, in order."""
    return {
        f"{name}.{path}" if path else name: module
        for name, layer in layers
        for path, module in layer.named_modules()
    }


def model_plan(layers: Sequence[Layer], given: Mapping[str, str], degree: int) -> dict[str, str]:
    """The tensor-parallel plan of the model given as ``layers``: full-model module names to
    ``"colwise"`` or ``"rowwise"``, from the layers' own ``tensor_parallel_plan(degree)``
    methods and ``given`` (names or ``*`` patterns) on top. ValueError names a plan that
    is empty, names no module or another kind of module, or splits features ``degree``
    does not divide."""
    modules = _modules(layers)
    plan: dict[str, str] = {}
    for name, module in modules.items():
        method = getattr(module, "tensor_parallel_plan", None)
        if callable(method):
            plan.update({f"{name}.{path}": style for path, style in method(degree).items()})
    for pattern, style in given.items():
        matched = [name for name in modules if fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            raise ValueError(
                f"tensor_parallel_plan names {pattern!r}, which matches no module of the model "
                f"(its modules are named as in the full model, such as {next(iter(modules))!r})"
            )
        plan.update(dict.fromkeys(matched, style))
    if not plan:
        raise ValueError(f"tensor_parallel={degree} needs a plan of how to split the model: {_FIX}")
    for name, style in plan.items():
        _check_entry(name, style, modules.get(name), degree)
    return {name: plan[name] for name in modules if name in plan}  # in the model's order


def _check_entry(name: str, style: str, module: nn.Module | None, degree: int) -> None:
    if style not in STYLES:
        raise ValueError(f"tensor-parallel plan entry {name!r} is {style!r}; use one of {STYLES}")
    if not isinstance(module, nn.Linear):
        kind = "nothing" if module is None else f"a {type(module).__name__}"
        raise ValueError(
            f"tensor-parallel plan entry {name!r} ({style}) names {kind}; name nn.Linear modules"
        )
    features, which = (
        (module.out_features, "output") if style == "colwise" else (module.in_features, "input")
    )
    if features % degree:
        raise ValueError(
            f"tensor_parallel={degree} cannot split the {features} {which} features of {name!r} "
            f"({style}); give a tensor_parallel that divides {features}"
        )


def check_stage_plans(
    plan: Mapping[str, str], layers: Sequence[Layer], balance: Sequence[int]
) -> None:
    """ValueError unless each stage's modules in ``plan`` come in (colwise, rowwise) pairs, in
    the order the layers register them (which the plan takes as their order of use), so
    that the tensors leaving every stage are whole on each process."""
    for stage, (start, stop) in enumerate(stage_bounds(balance)):
        named = [name for name in _modules(layers[start:stop]) if name in plan]
        styles = [plan[name] for name in named]
        if styles != ["colwise", "rowwise"] * (len(styles) // 2):  # an odd count differs too
            raise ValueError(
                f"stage {stage}'s tensor-parallel modules {named} ({', '.join(styles)}) must "
                "come as pairs, each colwise module followed by a rowwise one in the same "
                "stage, so that what leaves the stage is whole; cut the stages elsewhere "
                "(balance) or change the plan"
            )


def mirror_groups(degree: int, group: dist.ProcessGroup | None) -> list[dist.ProcessGroup]:
    """Two process groups of this process's mirrors (the ``degree`` consecutive processes of
    ``group`` that play one schedule rank): one for the messages they share, one for their
    DTensors. Every process must call it: torch.distributed needs every process to create
    every group, in order."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    mine: list[dist.ProcessGroup] = []
    for first in range(0, size, degree):
        ranks = [
            r if group is None else dist.get_global_rank(group, r)
            for r in range(first, first + degree)
        ]
        made = [dist.new_group(ranks), dist.new_group(ranks)]
        if first <= me < first + degree:
            mine = made
    return mine


def parallelize_stage(
    module: nn.Module, plan: Mapping[str, str], group: dist.ProcessGroup, mesh: DeviceMesh
) -> nn.Module:
    """Split ``module``'s (a stage's) entries of ``plan`` over ``mesh`` (its mirrors, whose
    process group is ``group``), after giving every mirror the first one's weights."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    source = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor, src=source, group=group)
    names = {name for name, _ in module.named_modules()}
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    held = {name: styles[style]() for name, style in plan.items() if name in names}
    if held:
        parallelize_module(module, mesh, held)
    return module


def counted_by_mirror(parameters: Sequence[torch.Tensor], leads: bool) -> list[torch.Tensor]:
    """Of ``parameters`` (those a rank counts in the global norm), the ones this mirror
    counts: its shards of split parameters, and the replicated ones only on the first
    mirror (``leads``), so that each element is counted once."""
    if leads:
        return list(parameters)
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None:
        return []
    return [p for p in parameters if isinstance(p, dtensor.DTensor) and _split_over_mirrors(p)]


def _split_over_mirrors(parameter: DTensor) -> bool:
    """Whether ``parameter`` is sharded over its mesh's ``tp`` dimension (the mirrors), not
    only over its replicas (``dp``)."""
    names = parameter.device_mesh.mesh_dim_names or ()
    return "tp" in names and parameter.placements[names.index("tp")].is_shard()


def schedule_ranks(processes: int, degree: int) -> int:
    """The schedule's ranks that ``processes`` play with ``degree`` mirrors each; ValueError
    unless ``degree`` is a positive int dividing ``processes``."""
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise ValueError(f"tensor_parallel must be a positive int, got {degree!r}")
    if processes % degree:
        raise ValueError(
            f"tensor_parallel={degree} plays each rank of the schedule on {degree} processes, "
            f"but the process group has {processes}; start (schedule ranks) x {degree} processes"
        )
    return processes // degree


def check_mirrorable(degree: int, asynchronous: bool, token_budget: bool) -> None:
    """ValueError for what ``tensor_parallel=degree`` > 1 does not run with yet, naming it."""
    if degree == 1:
        return
    refused = {
        "an asynchronous schedule (its weight versions)": asynchronous,
        "microbatch_tokens": token_budget,
    }
    found = [what for what, given in refused.items() if given]
    if found:
        raise ValueError(
            f"tensor_parallel={degree} does not run with {found[0]} yet; use a synchronous "
            "schedule (gpipe, 1f1b, zb-h1) by name, or tensor_parallel=1"
        )


class Mirrors:
    """This process's place among the ``degree`` consecutive processes of ``group`` (the
    pipeline's, ``None``: the default one) that play its schedule rank, and their groups.
    Every process must make it at the same point: it creates every group of mirrors."""

    def __init__(
        self, degree: int, group: dist.ProcessGroup | None, global_rank: Callable[[int], int]
    ) -> None:
        """Make the groups of mirrors of every rank, keeping this process's (``global_rank``:
        a process of the pipeline's group to the default group's rank)."""
        self.degree, self.global_rank = degree, global_rank
        self.messages, self.tensors = mirror_groups(degree, group)
        self.index = dist.get_rank(group) % degree
        self.leads = self.index == 0

    def replica_groups(self, schedule: Schedule) -> dict[int, dist.ProcessGroup]:
        """The replica groups (:func:`~pipetrain.runtime.rank.reduce.replica_groups`) of this
        process's place among its mirrors: a split parameter's shards sum with the same
        shards of the other replicas. Every process creates every place's groups."""
        made = []
        for place in range(self.degree):

            def process(rank: int, place: int = place) -> int:
                return self.global_rank(rank * self.degree + place)

            made.append(replica_groups(schedule, process))
        return made[self.index]

    def mesh(
        self,
        device: torch.device,
        replicas: Sequence[int] = (),
        group: dist.ProcessGroup | None = None,
    ) -> DeviceMesh:
        """The device mesh of this process's mirrors (``tp``), or, for a stage sharded over
        its ``replicas`` (schedule ranks; ``group``: their group of this place), of them all
        (``dp`` × ``tp``: FSDP over ``dp`` of what tensor parallelism splits over ``tp``)."""
        from torch.distributed.device_mesh import DeviceMesh

        if group is None:
            return DeviceMesh.from_group(self.tensors, device.type, mesh_dim_names=("tp",))
        places = range(self.degree)
        layout = [[self.global_rank(r * self.degree + t) for t in places] for r in replicas]
        return DeviceMesh.from_group(
            [group, self.tensors],
            device.type,
            mesh=torch.tensor(layout),
            mesh_dim_names=("dp", "tp"),
        )

    def parallelize(
        self, module: nn.Module, plan: Mapping[str, str], mesh: DeviceMesh
    ) -> nn.Module:
        """``module`` (a stage's) split over the ``tp`` dimension of ``mesh`` as ``plan`` says."""
        if isinstance(module, GraphStage):
            return distribute_graph_stage(module, plan, self.tensors, mesh["tp"])
        return parallelize_stage(module, plan, self.tensors, mesh["tp"])

    def shared_gradients(
        self,
        shared: Sequence[SharedParameter],
        schedule: Schedule,
        modules: Mapping[int, nn.Module],
        rank: int,
        sharded: bool,
    ) -> SharedGradients:
        """The :class:`SharedGradients` of this process's place among its mirrors: a shared
        parameter's copies sum with those of the same place of the other holder ranks.
        Every process creates every place's groups."""
        made = [
            SharedGradients(
                shared,
                schedule,
                modules if place == self.index else {},
                lambda rank, place=place: self.global_rank(rank * self.degree + place),  # type: ignore[misc]
                rank,
                sharded,
            )
            for place in range(self.degree)
        ]
        return made[self.index]


def stage_plan(
    front: FrontEnd, balance: Sequence[int], degree: int, given: Mapping[str, str], owned: bool
) -> dict[str, str] | None:
    """The checked tensor-parallel plan of ``front``'s model cut by ``balance``, or ``None``
    for ``degree`` 1; ``owned``: the pipeline makes its transport (mirrors need one over
    torch.distributed). ValueError names what cannot be split and the fix."""
    if degree == 1:
        return None
    if not owned:
        raise ValueError(
            f"tensor_parallel={degree} makes its own transport over torch.distributed; give none"
        )
    shared = shared_parameters(front, balance)
    if isinstance(front, GraphModel):  # its graph pass checks each stage's regions
        plan = model_plan(
            list(front.model.named_children()), captured_plan(front.model, given, degree), degree
        )
        split = [item.names[s] for item in shared for s in item.stages]
        held = [name for name in split if name.rpartition(".")[0] in plan]
        if held:
            raise ValueError(
                f"tensor_parallel={degree} keeps a parameter several stages use ({held[0]!r}) "
                "whole; leave its module out of the tensor-parallel plan"
            )
        return plan
    if shared:
        raise ValueError(
            f"tensor_parallel={degree} does not yet keep parameters several stages use "
            f"({shared[0].names[shared[0].stages[0]]!r}) one; cut the model so one stage holds "
            "them, or use tensor_parallel=1"
        )
    plan = model_plan(front.layers, given, degree)
    check_stage_plans(plan, front.layers, balance)
    return plan
