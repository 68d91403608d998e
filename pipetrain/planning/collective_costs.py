"""What a replicated stage's collectives cost a step: the all-reduce of whole copies'
gradients, or a sharded stage's all-gather of its weights and reduce-scatter of its
gradients.

On the links, a ring pass of a stage's weights over ``r`` replicas is ``r - 1`` messages in
turn, each carrying ``1/r`` of them; an all-reduce is two passes (a reduce-scatter and an
all-gather), a sharded stage's gather and its reduce-scatter one each. Where the profile
holds the workers' collectives as measured (:mod:`pipetrain.profiler.collectives`), each
costs no less than that: on CPU workers the backend's copies and reductions cost more than
the link's bytes.
"""

from __future__ import annotations

from pipetrain.planning.topology import Topology
from pipetrain.profiler.costs import Profile


def replica_collectives(
    profile: Profile,
    layers: tuple[int, int],
    replicas: int,
    shard: bool,
    ranks: tuple[int, int],
    topology: Topology,
) -> tuple[float, float]:
    """``(all-reduce, gather)`` seconds of the stage made of ``profile``'s ``layers``
    (start, stop) on ``replicas`` workers spanning ``ranks`` (lowest, highest) of
    ``topology``; a sharded stage's ``ALLREDUCE`` is its reduce-scatter."""
    if replicas == 1:
        return 0.0, 0.0
    start, stop = layers
    weights = sum(layer.parameter_bytes for layer in profile.layers[start:stop])
    ring_pass = (replicas - 1) * (
        topology.span_latency(*ranks) + weights / replicas / topology.span_bandwidth(*ranks)
    )
    measured = profile.collectives

    def at_least_measured(kind: str, on_links_s: float) -> float:
        if measured is None:
            return on_links_s
        return max(on_links_s, measured.seconds(kind, weights, replicas))

    if shard:
        return (
            at_least_measured("reduce_scatter", ring_pass),
            at_least_measured("gather", ring_pass),
        )
    return at_least_measured("allreduce", 2 * ring_pass), 0.0
