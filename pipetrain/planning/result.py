"""The planner's answer: :class:`Plan` (stages, replicas, schedule, micro-batches,
recomputation, predicted speed and memory) and its JSON form."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from pipetrain.jsonfile import JsonFile, unversioned, versioned
from pipetrain.planning.topology import Topology
from pipetrain.schedules import spec
from pipetrain.units import counted, format_bytes

FORMAT_VERSION = 6
"""Version of the JSON layout written by :meth:`Plan.save` (6: ``host_bytes``; 5: ``shard``
and ``rejected_layouts``; 4: ``ranks``, which version 3 called ``workers``; versions 5, 4
and 3 are still read, as plans of whole copies whose workers own their weights)."""


@dataclass
class PlanStage:
    """Layers ``start..stop-1`` on ``replicas`` ranks."""

    start: int
    stop: int
    replicas: int = 1


@dataclass
class Plan(JsonFile):
    """A chosen pipeline configuration and its predicted speed and memory.

    ``stages`` are in pipeline order (for a schedule with chunks, the ``virtual · ranks``
    model chunks, each on the rank its schedule's placement gives: ``c mod ranks`` for
    ``interleaved``, a V for ``zb-v``; ``virtual`` is the chunks per rank).
    ``stage_memory_bytes[i]`` is the predicted peak on a rank holding stage ``i`` and
    ``stage_compute_s[i]`` its forward and backward time for one micro-batch (recomputation
    included). ``predicted_step_s`` covers one training step of ``batch_size`` samples
    (one optimizer step of ``microbatches`` micro-batches of ``microbatch_size`` samples;
    two for ``2bw``, whose step plays two updates): with a measured profile, the median of
    :data:`~pipetrain.planning.choice.VARIED_RUNS` (up to 64) simulated steps whose actions
    vary as the profile's runs did; ``steady_step_s`` is the step with every action at its
    median time (the two are equal for a profile without runs). Stages sit on consecutive
    ranks in order. ``rejected`` names each other schedule the planner considered and why
    it lost (out of memory, no layout it runs, or slower). ``topology`` is the network
    planned for, in :meth:`pipetrain.planning.Topology.parse` syntax. ``model`` is the
    profile's: the model planned for (``""`` where the profile names none). ``shard``: the
    replicas of each replicated stage hold shards of it (run with
    ``PipelineConfig(shard=True)``, which :meth:`PipelineConfig.from_plan` sets; a stage
    on one rank holds it whole); ``rejected_layouts`` says why the other way of replicating
    stages (``replicated``: whole copies, or ``sharded``) lost.
    For a schedule whose weights live in a host store (``roundpipe``), ``stages`` are its
    ``virtual · ranks`` model stages, stage ``s`` dealt to rank ``s mod ranks``;
    ``stage_memory_bytes[i]`` is the working-set peak of the rank stage ``i`` is dealt to,
    and ``host_bytes`` what the host store holds (the whole model's weights, gradients and
    optimizer state; 0 for other schedules).
    """

    stages: list[PlanStage]
    schedule: str
    microbatches: int
    recompute: str
    predicted_step_s: float
    predicted_throughput: float
    stage_memory_bytes: list[float]
    ranks: int
    microbatch_size: int
    virtual: int = 1
    stage_compute_s: list[float] = field(default_factory=list)
    steady_step_s: float | None = None
    rejected: dict[str, str] = field(default_factory=dict)
    topology: str = ""
    model: str = ""
    shard: bool = False
    rejected_layouts: dict[str, str] = field(default_factory=dict)
    host_bytes: float = 0.0

    @property
    def balance(self) -> list[int]:
        """Layers per stage."""
        return [stage.stop - stage.start for stage in self.stages]

    @property
    def replicas(self) -> list[int]:
        """Ranks per stage."""
        return [stage.replicas for stage in self.stages]

    @property
    def batch_size(self) -> int:
        """Samples one training step (one ``train_step`` call) takes: ``microbatches`` per
        update, times the updates the schedule makes in a step (two for ``2bw``)."""
        family = spec(self.schedule)
        return family.window(self.microbatches, family.resolve({})) * self.microbatch_size

    @property
    def host_stored(self) -> bool:
        """Whether the schedule keeps the weights in a host store that the ranks load
        stages from (``roundpipe``)."""
        return spec(self.schedule).host_weights

    @property
    def layout_kind(self) -> str | None:
        """``replicated`` (whole copies) or ``sharded`` for a plan with a replicated stage,
        else ``None``."""
        if self.virtual > 1 or max(self.replicas, default=1) < 2:
            return None
        return "sharded" if self.shard else "replicated"

    def mesh(self) -> str:
        """The ranks as a mesh: ``pp 2 x dp 2, sharded`` where every stage has as many
        replicas, else the replicas per stage."""
        if self.host_stored:
            return f"{len(self.stages)} stages dealt round-robin over {self.ranks} ranks"
        replicas = self.replicas
        kind = self.layout_kind or "one rank per stage"
        if self.virtual == 1 and len(set(replicas)) == 1:
            return f"pp {len(replicas)} x dp {replicas[0]}, {kind}"
        if self.virtual > 1:
            return f"pp {self.ranks} x dp 1, {len(self.stages)} chunks"
        return f"pp {len(replicas)}, replicas {replicas} per stage, {kind}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dictionary with a ``format_version``."""
        return versioned(FORMAT_VERSION, asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Rebuild a plan from :meth:`to_dict` output; raise ValueError on another format."""
        advice = "Make it again with `pipetrain plan` (or pipetrain.plan())."
        if isinstance(data, dict) and data.get("format_version") == 3:
            data = {**data, "format_version": 4, "ranks": data.get("workers")}
            data.pop("workers")
        if isinstance(data, dict) and data.get("format_version") in (4, 5):
            data = {**data, "format_version": FORMAT_VERSION}
        fields = unversioned(data, "plan", FORMAT_VERSION, advice)
        try:
            fields["stages"] = [PlanStage(**stage) for stage in fields["stages"]]
            return cls(**fields)
        except (KeyError, TypeError) as error:
            raise ValueError(f"the plan is incomplete or has unknown fields: {error}") from None

    def describe(self) -> str:
        """A readable summary, one table row per stage, and the schedules rejected and why."""
        chunks = f", {self.virtual} chunks per rank" if self.virtual > 1 else ""
        if self.host_stored:
            chunks = f", {self.virtual} per rank from a host store"
        network = f" ({self.topology})" if self.topology and _has_links(self.topology) else ""
        updates = self.batch_size // (self.microbatches * self.microbatch_size)
        per_update = f" per update, {updates} updates a step" if updates > 1 else ""
        lines = [
            f"{self.schedule}: {counted(len(self.stages), 'stage')} on "
            f"{counted(self.ranks, 'rank')}{network}{chunks}, "
            f"{counted(self.microbatches, 'micro-batch', 'micro-batches')} of "
            f"{self.microbatch_size}{per_update}, recomputation {self.recompute}",
            f"predicted step {self.predicted_step_s:.4g} s, "
            f"{self.predicted_throughput:.4g} samples/s{self._steady()}",
            f"mesh: {self.mesh()}",
            f"{'stage':>5}  {'layers':>11}  {'count':>5}  {'replicas':>8}  "
            f"{'compute/mb':>10}  {'memory/rank':>13}",
        ]
        computes = self.stage_compute_s or [math.nan] * len(self.stages)
        for index, (stage, compute, memory) in enumerate(
            zip(self.stages, computes, self.stage_memory_bytes)
        ):
            lines.append(
                f"{index:>5}  {f'{stage.start}..{stage.stop - 1}':>11}  "
                f"{stage.stop - stage.start:>5}  {stage.replicas:>8}  {compute:>9.4g}s  "
                f"{format_bytes(memory):>13}"
                + ("  sharded" if self.shard and stage.replicas > 1 else "")
            )
        for index, stage in enumerate(self.stages):
            if stage.replicas > self.microbatches:  # micro-batches go round the replicas
                idle = stage.replicas - self.microbatches
                lines.append(
                    f"stage {index}: {self.microbatches} of its {stage.replicas} replicas get "
                    f"a micro-batch; the other {idle} only join its all-reduce"
                )
        if self.host_stored:
            lines.append(
                f"host store: {format_bytes(self.host_bytes)} (the model's weights, gradients "
                "and optimizer state, once for all ranks)"
            )
        if self.rejected:
            lines.append("rejected:")
            lines += [f"  {name}: {reason}" for name, reason in self.rejected.items()]
        if self.rejected_layouts:
            lines.append("layouts rejected:")
            lines += [f"  {kind}: {reason}" for kind, reason in self.rejected_layouts.items()]
        return "\n".join(lines)

    def _steady(self) -> str:
        """The steady step and throughput (every action at its median time: the scale the
        planner compares candidates and rejections on) after the predicted ones."""
        steady_s = self.steady_step_s
        if steady_s is None:  # a plan saved before steady steps were kept
            return ""
        if steady_s == self.predicted_step_s or steady_s <= 0:
            return " (steady: every action at its given time, the scale candidates are compared on)"
        throughput = self.predicted_throughput * self.predicted_step_s / steady_s
        return (
            " with the profile's run-to-run variation; steady (with every action at its median "
            f"time, the scale candidates are compared on): {steady_s:.4g} s, "
            f"{throughput:.4g} samples/s"
        )


def _has_links(topology: str) -> bool:
    """Whether a topology string names a link with a finite bandwidth or a latency."""
    return any(
        level.bandwidth < math.inf or level.latency_s > 0
        for level in Topology.parse(topology).levels
    )
