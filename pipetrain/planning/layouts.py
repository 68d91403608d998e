"""The stage layouts worth simulating for one step's costs: PipeDream's replicated pipeline
(on the hierarchical topology and on one level at its slowest link, with the workers it
leaves idle given to each stage in turn), the least-bottleneck pipeline of each depth, a
straight pipeline, one with :data:`VIRTUAL_CHUNKS` chunks per worker, and for a family whose
weights live in a host store, the model cut into :data:`HOST_STAGES_PER_WORKER` times as
many stages as workers, dealt round-robin; and :class:`Layout`, what each stage holds and on
how many workers."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property

from pipetrain.planning.depths import by_depth
from pipetrain.planning.host_store import STAGES_OPTION
from pipetrain.planning.partition import partition
from pipetrain.planning.replicate import replicate
from pipetrain.planning.topology import Topology
from pipetrain.profiler.costs import Profile
from pipetrain.schedules import spec

VIRTUAL_CHUNKS = 2
"""Model chunks per rank in the candidates of schedules with chunks."""


@dataclass(frozen=True)
class Layout:
    """Stages as ``(start, stop, replicas)`` in pipeline order; ``virtual`` chunks per rank;
    ``shard``: the replicated stages' replicas hold shards; ``host_link``: the stages live
    in a host store and are dealt round-robin over the workers (``virtual`` each), which
    load them over a link of this many bytes/s (``None``: the workers own their stages)."""

    stages: tuple[tuple[int, int, int], ...]
    virtual: int = 1
    shard: bool = False
    host_link: float | None = None

    @cached_property
    def replicas(self) -> list[int]:
        """Workers per stage."""
        return [replicas for _, _, replicas in self.stages]

    @property
    def workers(self) -> int:
        """Workers the layout occupies."""
        if self.virtual > 1:
            return len(self.stages) // self.virtual
        return sum(self.replicas)

    @cached_property
    def offsets(self) -> list[int]:
        """First rank of each stage (consecutive placement)."""
        return [0, *itertools.accumulate(self.replicas)][:-1]

    def runs(self, schedule: str, microbatches: int) -> bool:
        """Whether ``schedule`` can run this layout with ``microbatches`` micro-batches.

        Replicated layouts go to synchronous replicable families only: the replication
        planner proposes them under one all-reduce per step. A sharded one also needs every
        replica to run a micro-batch (as many micro-batches as the most replicas).
        """
        family = spec(schedule)
        if family.host_weights or self.host_link is not None:
            dealt = {STAGES_OPTION: len(self.stages)}
            return (
                family.host_weights
                and self.host_link is not None
                and family.accepts(self.workers, microbatches, None, dealt)
            )
        if self.virtual > 1:
            chunked = {family.chunk_option: self.virtual} if family.chunk_option else None
            return chunked is not None and family.accepts(self.workers, microbatches, None, chunked)
        if family.chunk_option is not None:
            return False
        if self.shard and microbatches < max(self.replicas):
            return False
        if max(self.replicas) > 1:
            return (
                family.replicable
                and not family.asynchronous
                and family.accepts(self.workers, microbatches, self.replicas)
            )
        return family.accepts(self.workers, microbatches)


HOST_STAGES_PER_WORKER = (1, 2, 3, 4)
"""Stages per worker in the layouts of a family whose weights live in a host store: finer
stages shorten its fill and drain and its working set, and cost more loads."""

HOST_MAX_STAGES = 128
"""The most stages such a layout deals beyond one a worker: its schedule's actions, and so
the planner's bounds and simulations of it, grow with them (on 64 workers, 3 and 4 stages a
worker cost the default planning case a tenth more time for plans that did not win)."""


def layouts(
    step_profile: Profile,
    topology: Topology,
    replication: bool,
    interleaved: bool,
    host_link: float | None = None,
) -> list[Layout]:
    """The stage layouts worth simulating for one step's costs.

    ``step_profile`` holds costs for a whole step (all micro-batches), which is what the
    replication planner weighs against one all-reduce per step. Layouts, where the layer
    count allows:

    - with ``replication``, PipeDream's replicated pipeline on the hierarchical topology and,
      for several levels, on a flat topology priced at the slowest link (whole-component
      levels cannot express plans such as "15-1" on 4×4 workers); where a plan leaves workers
      idle, also with the idle workers added to each of its stages in turn; and, on the
      flat topology, the least-bottleneck pipeline of each depth on every worker
      (:func:`pipetrain.planning.depths.by_depth`: the cost model ranks plans of different
      depths without their bubbles and latencies, which the simulation adds);
    - a straight pipeline with one stage per worker;
    - with ``interleaved`` (any schedule with chunks asked for), :data:`VIRTUAL_CHUNKS`
      chunks per worker, split as if chunk ``c`` sat on rank ``c mod p`` (one split for
      every such schedule: exact on one level of links);
    - with a ``host_link`` (bytes/s; a family whose weights live in a host store asked
      for), the layers cut into ``v·p`` stages for each ``v`` of
      :data:`HOST_STAGES_PER_WORKER` that the layers allow (and, beyond ``v = 1``,
      :data:`HOST_MAX_STAGES`), dealt round-robin (stage ``s`` on worker ``s mod p``),
      each loaded over the workers' link to the host.
    """
    layers = step_profile.layers
    compute = [layer.compute_s for layer in layers]
    activations = [layer.activation_bytes for layer in layers]
    found: list[Layout] = []
    if replication:
        weights = [layer.parameter_bytes for layer in layers]
        slowest = min(level.bandwidth for level in topology.levels)
        networks = (
            [topology]
            if len(topology.levels) == 1
            else [topology, Topology.flat(topology.workers, slowest)]
        )
        for network in networks:
            replicated = replicate(compute, weights, activations, network, sync="step")
            _add(
                found,
                _with_idle_workers(
                    [(s.start, s.stop, s.replicas) for s in replicated.stages], topology.workers
                ),
            )
        for stages in by_depth(compute, weights, activations, topology.workers, slowest):
            _add(found, [Layout(tuple((s.start, s.stop, s.replicas) for s in stages))])
    workers = topology.workers
    splits: dict[int, tuple[tuple[int, int, int], ...] | None] = {}  # by stages a worker
    for virtual in (1, VIRTUAL_CHUNKS) if interleaved and workers > 1 else (1,):
        split = splits[virtual] = _round_robin(compute, activations, topology, virtual)
        if split is not None:
            _add(found, [Layout(split, virtual)])
    for per_worker in HOST_STAGES_PER_WORKER if host_link is not None else ():
        if per_worker > 1 and per_worker * workers > HOST_MAX_STAGES:
            break
        if per_worker not in splits:  # the same split as a pipeline's with as many chunks
            splits[per_worker] = _round_robin(compute, activations, topology, per_worker)
        dealt = splits[per_worker]
        if dealt is not None:
            _add(found, [Layout(dealt, per_worker, host_link=host_link)])
    return found


def _round_robin(
    compute: list[float], activations: list[float], topology: Topology, per_worker: int
) -> tuple[tuple[int, int, int], ...] | None:
    """The layers split into ``per_worker`` stages a worker, stage ``c`` on worker
    ``c mod p`` (least bottleneck); ``None`` where the layers are too few."""
    workers = topology.workers
    chunks = per_worker * workers
    if chunks > len(compute):
        return None
    links = [topology.span_bandwidth(c % workers, (c + 1) % workers) for c in range(chunks - 1)]
    balance = partition(compute, chunks, activations, links)
    bounds = [sum(balance[:index]) for index in range(chunks + 1)]
    return tuple((bounds[c], bounds[c + 1], 1) for c in range(chunks))


def _with_idle_workers(stages: list[tuple[int, int, int]], workers: int) -> list[Layout]:
    """A replicated layout and, if it leaves workers idle, the variants that give them to
    one stage."""
    idle = workers - sum(replicas for _, _, replicas in stages)
    variants = [Layout(tuple(stages))]
    for index, (start, stop, replicas) in enumerate(stages if idle else []):
        variants.append(
            Layout((*stages[:index], (start, stop, replicas + idle), *stages[index + 1 :]))
        )
    return variants


def _add(found: list[Layout], layouts_to_add: list[Layout]) -> None:
    """Append the layouts not already in ``found``."""
    for layout in layouts_to_add:
        if layout not in found:
            found.append(layout)
