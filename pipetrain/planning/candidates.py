"""Candidate pipelines for the planner: their layouts, simulator costs, memory and bounds.

A :class:`~pipetrain.planning.layouts.Layout` says which layers each stage holds and on how
many workers (the layouts worth simulating come from :mod:`~pipetrain.planning.layouts`);
a :class:`Candidate` adds
the schedule, micro-batch count and recomputation mode, and knows how to turn the profile
into :class:`pipetrain.simulation.Costs` for its stages. Workers are
placed as :func:`pipetrain.schedules.build` places them: each stage on consecutive ranks,
and chunk ``c`` of a schedule with chunks where its spec's ``placement`` puts it
(``c mod p`` for ``interleaved``, a V for ``zb-v``).

A layout with ``shard`` has its replicated stages held as shards (less memory, see
:func:`~pipetrain.planning.memory.worker_memory`): its schedule has each replica all-gather
its stage's weights first (``GATHER``, :func:`~pipetrain.schedules.gathers.with_gathers`,
costing a ring pass, ``Costs.gather_s``), and its ``ALLREDUCE`` is a ring reduce-scatter
(:mod:`~pipetrain.planning.collective_costs`).

A layout with a ``host_link`` is one for a family whose weights live in a host store
(``roundpipe``): its ``virtual · N`` stages are dealt round-robin over the ``N`` workers,
which load each stage's weights over a link of ``host_link`` bytes/s (``Costs.load_s``,
the stage's weight bytes over it) and return its gradients the same way
(``Costs.offload_s``); the worker then steps the stage's optimizer in the store, on its own
compute, which is added to the stage's backwards there, shared out over its micro-batches.
Its memory is the worker's working set (:mod:`~pipetrain.planning.host_store`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from pipetrain.planning.bounds import written_bound
from pipetrain.planning.collective_costs import replica_collectives
from pipetrain.planning.host_store import (
    RESIDENT_OPTION,
    STAGES_OPTION,
    dealt_memory,
    host_link_costs,
)
from pipetrain.planning.layouts import Layout
from pipetrain.planning.memory import StageFootprint, worker_memory
from pipetrain.planning.sharing import shared_cores_stretch
from pipetrain.planning.topology import Topology
from pipetrain.profiler.costs import Profile
from pipetrain.schedules import Schedule, build, spec
from pipetrain.schedules.gathers import with_gathers
from pipetrain.simulation import Costs, Variation, simulate
from pipetrain.timeline import Timeline


@dataclass(frozen=True)
class Candidate:
    """One configuration to simulate: layout, schedule, micro-batches, recomputation."""

    layout: Layout
    schedule: str
    microbatches: int
    recompute: str
    profile: Profile

    @property
    def recompute_flags(self) -> list[bool]:
        """Per stage (chunk): whether its backward re-materialises the activations.

        As the runtime does it, ``except_last`` and ``always`` recompute on every stage;
        ``except_last`` keeps the last micro-batch, whose backward follows at once.
        """
        return [self.recompute != "never"] * len(self.layout.stages)

    @property
    def keeps_last(self) -> bool:
        """Whether the memory model keeps each stage's last micro-batch whole: a host
        store's ``except_last``, whose last forwards' backwards come after the turn."""
        return self.recompute == "except_last" and self.layout.host_link is not None

    @property
    def recompute_share(self) -> float:
        """The share of micro-batches whose forward runs again in the backward."""
        if self.recompute == "except_last":
            return (self.microbatches - 1) / self.microbatches
        return 1.0 if self.recompute == "always" else 0.0

    def memory(self) -> list[float]:
        """Peak bytes on a worker of each stage (for a chunk: its rank's total)."""
        stages, flags = self.layout.stages, self.recompute_flags
        footprints = [StageFootprint.of(self.profile, start, stop) for start, stop, _ in stages]
        if self.layout.host_link is not None:
            resident = int(self.options[RESIDENT_OPTION])
            workers, keeps_last = self.layout.workers, self.keeps_last
            return dealt_memory(footprints, flags, workers, self.microbatches, resident, keeps_last)
        if self.layout.virtual == 1:
            replicas = self.layout.replicas
            return [
                worker_memory(
                    [footprints[s]],
                    [flags[s]],
                    self.schedule,
                    s,
                    self.microbatches,
                    replicas,
                    shard=self.layout.shard,
                )
                for s in range(len(stages))
            ]
        ranks = self.layout.workers
        per_rank = []
        for rank in range(ranks):
            chunks = self.chunks_of(rank)
            per_rank.append(
                worker_memory(
                    [footprints[c] for c in chunks],
                    [flags[c] for c in chunks],
                    self.schedule,
                    rank,
                    self.microbatches,
                    [1] * ranks,
                )
            )
        return [per_rank[self.ranks_of(chunk)[0]] for chunk in range(len(stages))]

    @cached_property
    def options(self) -> dict[str, int | bool]:
        """The schedule's options for this layout, defaults filled in."""
        return spec(self.schedule).resolve(self._arguments()[3])

    def ranks_of(self, stage: int) -> tuple[int, int]:
        """The first and last rank holding ``stage``: the schedule's placement for chunks,
        consecutive ranks for stages."""
        return self._rank_spans[stage]

    @cached_property
    def _rank_spans(self) -> list[tuple[int, int]]:
        """:meth:`ranks_of` of every stage (costs, memory and bounds ask for them often)."""
        layout = self.layout
        if layout.virtual > 1 or layout.host_link is not None:
            placement = spec(self.schedule).placement
            return [
                (rank, rank)
                for rank in (placement(c, layout.workers) for c in range(len(layout.stages)))
            ]
        return [
            (first, first + replicas - 1)
            for first, (_, _, replicas) in zip(layout.offsets, layout.stages)
        ]

    def chunks_of(self, rank: int) -> list[int]:
        """The chunks (model stages) ``rank`` holds, in pipeline order."""
        return self._chunks_by_rank[rank]

    @cached_property
    def _chunks_by_rank(self) -> list[list[int]]:
        held: list[list[int]] = [[] for _ in range(self.layout.workers)]
        for chunk in range(len(self.layout.stages)):
            held[self.ranks_of(chunk)[0]].append(chunk)
        return held

    def costs(self, topology: Topology) -> Costs:
        """Per-stage times and per-boundary transfers for :func:`pipetrain.simulation.simulate`."""
        layers, layout = self.profile.layers, self.layout
        forward, backward, weight, allreduce, gather = [], [], [], [], []
        for stage, ((start, stop, replicas), again) in enumerate(
            zip(layout.stages, self.recompute_flags)
        ):
            part = layers[start:stop]
            forward_s = sum(layer.forward_s for layer in part)
            weight_s = sum(layer.weight_share_s for layer in part)
            forward.append(forward_s)
            weight.append(weight_s)
            backward.append(
                sum(layer.backward_s for layer in part)
                - weight_s
                + (forward_s * self.recompute_share if again else 0.0)
            )
            allreduce_s, gather_s = replica_collectives(
                self.profile,
                (start, stop),
                replicas,
                layout.shard,
                self.ranks_of(stage) if replicas > 1 else (0, 0),
                topology,
            )
            allreduce.append(allreduce_s)
            gather.append(gather_s)
        boundaries = range(len(layout.stages) - 1)
        sizes = [layers[layout.stages[b][1] - 1].activation_bytes for b in boundaries] or [0.0]
        spans = [self._span(b) for b in boundaries]
        links = [topology.span_bandwidth(*span) for span in spans] or [math.inf]
        latency = max((topology.span_latency(*span) for span in spans), default=0.0)
        everyone = 2 * (layout.workers - 1) * topology.span_latency(0, layout.workers - 1)
        # an asynchronous update also copies its stage's next weight version
        version_byte_s = (
            self.profile.weight_version_byte_s if spec(self.schedule).asynchronous else 0.0
        )
        steps = [
            sum(layer.optimizer_s + layer.parameter_bytes * version_byte_s for layer in part)
            for part in (layers[start:stop] for start, stop, _ in layout.stages)
        ]
        layer_spans = [(start, stop) for start, stop, _ in layout.stages]
        load, offload = host_link_costs(self.profile, layer_spans, layout.host_link)
        if layout.host_link is not None:
            # a worker steps a stage's optimizer in the store as it returns the gradients:
            # its own compute, shared out over the stage's backwards there
            played = spec(self.schedule).window(self.microbatches, self.options)
            backward = [b + step / played for b, step in zip(backward, steps)]
        # each message keeps its sender busy while packing it and handing its bytes over,
        # and its receiver while copying it in
        message = self.profile.message_s
        return Costs(
            forward,
            [max(b, 0.0) for b in backward],
            weight,
            sizes,
            links,
            latency_s=latency,
            step_s=steps,
            allreduce_s=allreduce,
            gather_s=gather,
            send_s=message,
            receive_s=message,
            send_byte_s=self.profile.send_byte_s,
            receive_byte_s=self.profile.receive_byte_s,
            # the loss all-reduce that ends the step: one small message, round the ring
            loss_s=message + everyone,
            load_s=load,
            offload_s=offload,
        )

    def _span(self, boundary: int) -> tuple[int, int]:
        """The lowest and highest rank among the workers of the stages on both sides of
        ``boundary``: a message across it is as slow as the slowest link among them."""
        ranks = [*self.ranks_of(boundary), *self.ranks_of(boundary + 1)]
        return min(ranks), max(ranks)

    def lower_bound(self, costs: Costs) -> float:
        """A makespan no schedule can beat.

        A worker of stage ``s`` idles until the first micro-batch has passed the forwards of
        the stages before it (a sharded stage also until its gather ends), then does its own
        work (``⌈m / r_s⌉`` of the ``m`` micro-batches its step plays, two updates' worth for
        ``2bw``); after its last backward come its all-reduce and, unless the backward is
        split, the backwards of the earlier stages, which overlap: the longer counts. A rank
        ``r`` holding chunks likewise waits for chunks ``0..r-1`` before its first forward
        and, unless the backward is split, after its last backward; with its stages in a
        host store, its first forward also waits for its first stage's load, and the return
        of that stage's gradients follows its last backward.
        """
        family = spec(self.schedule)
        played = family.window(self.microbatches, family.resolve({}))
        count = len(self.layout.stages)
        forward = costs.per_stage("forward_s", count)
        backward = costs.per_stage("backward_s", count)
        weight = costs.per_stage("weight_s", count)
        allreduce = costs.per_stage("allreduce_s", count)
        work = [f + b + w for f, b, w in zip(forward, backward, weight)]
        split = family.split_backward
        if self.layout.virtual > 1 or self.layout.host_link is not None:
            held = [self.chunks_of(rank) for rank in range(self.layout.workers)]
            load, offload = costs.per_stage("load_s", count), costs.per_stage("offload_s", count)
            return max(
                max(sum(forward[: chunks[0]]), load[chunks[0]])
                + played * sum(work[c] for c in chunks)
                + max(
                    0.0 if split else sum(work[: chunks[0]]) - sum(forward[: chunks[0]]),
                    offload[chunks[0]],
                )
                for chunks in held
                if chunks
            )
        gather = costs.per_stage("gather_s", count)
        bound = head = tail = 0.0
        for stage, replicas in enumerate(self.layout.replicas):
            busy = math.ceil(played / replicas) * work[stage]
            head = max(head, gather[stage])  # a sharded stage's first pass after its gather
            # the earlier stages' backwards run while this stage all-reduces
            bound = max(bound, head + busy + max(allreduce[stage], 0.0 if split else tail))
            head += forward[stage]
            tail += backward[stage] + weight[stage]
        return bound

    def variation(self) -> Variation | None:
        """How each stage's forward and backward varied in the profile's measured runs, or
        ``None`` when the profile has no runs (written by hand, or loaded from one without)."""
        spread = self.profile.spread
        if spread is None:
            return None
        layers = self.profile.layers
        forward, backward = [], []
        for start, stop, _ in self.layout.stages:
            medians = (
                sum(layer.forward_s for layer in layers[start:stop]),
                sum(layer.backward_s for layer in layers[start:stop]),
            )
            stage_forward, stage_backward = spread.stage_factors(start, stop, medians)
            forward.append(stage_forward)
            backward.append(stage_backward)
        return Variation(forward, backward)

    def _arguments(self) -> tuple[int, int, list[int] | None, dict[str, int | bool]]:
        """Ranks, micro-batches, replicas (None unless replicated) and options to build it."""
        family, layout = spec(self.schedule), self.layout
        options: dict[str, int | bool] = (
            {family.chunk_option: layout.virtual} if family.chunk_option else {}
        )
        if layout.host_link is not None:
            options = {STAGES_OPTION: len(layout.stages)}
        replicas = layout.replicas if max(layout.replicas) > 1 else None
        return layout.workers, self.microbatches, replicas, options

    def build(self) -> Schedule:
        """The candidate's schedule (with its sharded stages' gathers)."""
        ranks, microbatches, replicas, options = self._arguments()
        built = build(self.schedule, ranks, microbatches, replicas=replicas, **options)
        return with_gathers(built) if self.layout.shard else built

    def written_bound(self, costs: Costs) -> float | None:
        """A makespan its simulation on ``costs`` cannot beat, from its schedule's written
        passes (:func:`pipetrain.planning.bounds.written_bound`; ``None`` where it gives
        none); tighter than :meth:`lower_bound` and slower to find."""
        return written_bound(self.schedule, *self._arguments(), costs)

    def build_and_simulate(
        self, costs: Costs, cores: int | None = None
    ) -> tuple[Timeline, int, Costs]:
        """:meth:`simulate` on the candidate's schedule, built."""
        return self.simulate(self.build(), costs, cores)

    def simulate(
        self, schedule: Schedule, costs: Costs, cores: int | None = None
    ) -> tuple[Timeline, int, Costs]:
        """Simulate ``schedule`` (the candidate's, built); return the timeline, the
        micro-batches it processed, and the costs it ran on: ``costs``, with its work slowed
        by the profile's ``shared_cores_factor`` and stretched where its workers share
        ``cores`` cores (None: a core each; see :mod:`pipetrain.planning.sharing`)."""
        shared, timeline = shared_cores_stretch(
            lambda trial: simulate(schedule, trial),
            costs,
            schedule.stages,
            self.layout.workers,
            self.layout.workers if cores is None else cores,
            self.profile.shared_cores_factor,
        )
        return timeline, schedule.microbatches, shared


def step_costs(profile: Profile, microbatches: int) -> Profile:
    """A profile whose times and activations cover ``microbatches`` micro-batches at once."""
    return profile.scaled(profile.microbatch_size * microbatches)
