"""Choose a pipeline plan: stages, replicas, schedule, micro-batches and recomputation.

:func:`plan` builds candidate layouts (PipeDream's replicated pipeline, a straight pipeline,
one with two chunks per worker), keeps the configurations whose per-worker memory fits,
simulates them on the profiled costs with :mod:`pipetrain.simulate` (those that bounds
cannot rule out, :mod:`~pipetrain.planning.choice`), and returns the fastest as a
:class:`Plan`, with the reason each other schedule lost. The replication planner
proposes layouts under PipeDream's cost model, in which an all-reduce overlaps compute; the
simulation then prices every candidate as its schedule runs it (the all-reduce after the
last backward), and decides. The chosen plan's predicted step then allows for the run-to-run
variation the profile measured.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

from pipetrain.planning.candidates import Candidate
from pipetrain.planning.choice import FEWER_WITHIN as FEWER_WITHIN
from pipetrain.planning.choice import fastest
from pipetrain.planning.fitting import fitting_candidates
from pipetrain.planning.host_store import DEFAULT_HOST_BANDWIDTH, host_store_bytes
from pipetrain.planning.result import Plan
from pipetrain.planning.topology import Topology, resolve
from pipetrain.planning.verdicts import Verdicts
from pipetrain.profiler.costs import Profile
from pipetrain.schedules import names, spec
from pipetrain.units import counted, format_bytes

DEFAULT_MICROBATCHES = (1, 2, 4, 8, 16, 32, 64)

MAX_LAYERS = 8192
"""The most layers :func:`plan` takes: planning 16 workers takes 6 s and 0.2 GB for 4,000
layers, 73 s and 2.8 GB for 16,000 on a 2-core machine, growing with the square."""


def plan(
    profile: Profile,
    workers: int | None = None,
    topology: Topology | str | None = None,
    memory_limit: float | None = None,
    schedules: Sequence[str] | None = None,
    microbatches: Sequence[int] = DEFAULT_MICROBATCHES,
    batch_size: int | None = None,
    replication: bool = True,
    progress: Callable[[str], None] | None = None,
    every_worker: bool = False,
    shared_cores: int | None = None,
    *,
    exhaustive: bool = False,
    shard: bool | Literal["only"] = True,
    host_bandwidth: float = DEFAULT_HOST_BANDWIDTH,
    host_memory_limit: float | None = None,
) -> Plan:
    """The fastest plan whose every worker fits in ``memory_limit`` bytes (None: no limit).

    ``topology`` (a :class:`Topology` or a string such as ``"4x16GB/s,4x10Gbit/s"``) gives
    the workers and links; without it ``workers`` workers share infinitely fast links.
    With ``batch_size`` each step processes that many samples split into micro-batches
    (the profile is rescaled to each micro-batch size); without it a micro-batch is the
    profile's and the step grows with the micro-batch count. Candidates: PipeDream's
    replicated pipeline (unless ``replication`` is False), a straight pipeline with one
    stage per worker, and for the schedules with chunks a pipeline of two per worker; each
    with every requested schedule that can run it, every micro-batch count, and the
    cheapest recomputation mode that fits. Recomputation adds one forward of the stage to
    its backward (for ``except_last``, on all micro-batches but the last). The fastest by
    simulated throughput wins; the plan's ``rejected`` says why each other schedule lost.
    ``progress``, if given, receives a line as each part of the work starts (the layouts for
    each micro-batch count, each simulated candidate). With ``every_worker``, only layouts
    that give every worker work are considered (a job of that many processes needs them);
    otherwise a replicated layout may leave workers idle when that is as fast.
    ``shared_cores``: the workers all share this many cores (local workers, or an emulated
    cluster on one machine), so compute stretches when more of them are busy at once (see
    :mod:`pipetrain.planning.sharing`); ``None``: each worker has its own.
    With ``shard``, every layout with replicated stages is also tried with their replicas
    holding shards (``PipelineConfig(shard=True)``: less memory a worker, the weights
    all-gathered at the start of each step; see :mod:`~pipetrain.planning.candidates`); on
    a tie whole copies win. ``Plan.rejected_layouts`` says why the other kind lost.
    ``shard="only"`` plans only sharded layouts (every layout with replicated stages, its
    replicas holding shards): for a model that must be sharded for reasons the profile
    does not show.
    A family whose weights live in a host store (``roundpipe``) is planned on the layers
    cut into 1, 2, 3 and 4 times as many stages as workers, dealt round-robin; its
    ``memory_limit`` is a worker's working set (the stages it holds at once and its stages'
    activations: :mod:`~pipetrain.planning.host_store`), so it can fit a model no other
    family fits. Each worker loads a stage's weights and returns its gradients over a link
    of ``host_bandwidth`` bytes/s (default 10 GB/s, a CPU's memcpy from shared memory,
    :data:`~pipetrain.planning.host_store.DEFAULT_HOST_BANDWIDTH`; for GPU workers give
    their PCIe link's, about 25e9 for PCIe 4.0 x16); each worker steps the optimizer of the
    stages it returns in the store, on its own compute. Its host store holds the whole model
    once (``Plan.host_bytes``); a store above ``host_memory_limit`` bytes (None: no limit)
    rules the family out.
    ``exhaustive`` simulates every candidate that the stage-sum bound leaves in, without
    the tighter written bound that spares most simulations (see
    :mod:`pipetrain.planning.choice`): the same plan, slower; for checking that claim.
    """
    if shared_cores is not None and (
        isinstance(shared_cores, bool) or not isinstance(shared_cores, int) or shared_cores < 1
    ):
        raise ValueError(f"shared_cores must be a positive integer or None, got {shared_cores!r}")
    if not isinstance(profile, Profile):
        raise TypeError(f"profile must be a pipetrain.Profile, got {type(profile).__name__}")
    if len(profile) > MAX_LAYERS:
        raise ValueError(
            f"the profile has {len(profile):,} layers, more than the {MAX_LAYERS:,} the planner "
            "takes (its partitioning costs time and memory with the square of the layer "
            "count); profile the model in coarser layers, such as its blocks"
        )
    topology = resolve(topology, workers)
    schedules = _checked_schedules(schedules)
    counts = _microbatch_counts(microbatches, batch_size)
    if memory_limit is not None and not memory_limit > 0:
        raise ValueError(
            f"memory_limit must be a positive number of bytes per worker, got {memory_limit!r}"
        )
    if shard not in (True, False, "only"):
        raise ValueError(f"shard must be True, False or 'only', got {shard!r}")
    _check_host(host_bandwidth, host_memory_limit)
    report = progress or _silent
    verdicts = Verdicts(schedules)
    host_bytes = host_store_bytes(profile)
    if host_memory_limit is not None and host_bytes > host_memory_limit:
        schedules = _without_host_store(schedules, host_bytes, host_memory_limit, verdicts)
    fitting, smallest = fitting_candidates(
        profile,
        topology,
        schedules,
        counts,
        batch_size,
        replication,
        memory_limit,
        report,
        verdicts,
        every_worker,
        shard,
        host_bandwidth,
    )
    if not fitting:
        hosted = any(spec(name).host_weights for name in schedules)
        raise ValueError(
            _no_fit_message(memory_limit, smallest, profile, topology, replication, hosted)
        )
    chosen = fastest(fitting, topology, report, verdicts, shared_cores, exhaustive)
    chosen.rejected = verdicts.rejected(chosen.schedule, memory_limit)
    chosen.rejected_layouts = verdicts.rejected_layouts(chosen.layout_kind, memory_limit)
    if spec(chosen.schedule).host_weights:
        chosen.host_bytes = host_bytes
    return chosen


def _without_host_store(
    schedules: tuple[str, ...], host_bytes: float, limit: float, verdicts: Verdicts
) -> tuple[str, ...]:
    """``schedules`` but those whose host store of ``host_bytes`` exceeds ``limit``, each
    told to ``verdicts``; ValueError where none is left."""
    hosted = [name for name in schedules if spec(name).host_weights]
    for name in hosted:
        verdicts.host_over(name, host_bytes, limit)
    kept = tuple(name for name in schedules if name not in hosted)
    if not kept:
        raise ValueError(
            f"{hosted[0]} keeps the whole model in a host store of {format_bytes(host_bytes)}, "
            f"over the host memory limit of {format_bytes(limit)}; raise the limit "
            "(host_memory_limit, pipetrain plan --host-memory) or plan other schedules"
        )
    return kept


def _check_host(host_bandwidth: float, host_memory_limit: float | None) -> None:
    """Refuse a host link or host memory limit that is not a positive number."""
    if isinstance(host_bandwidth, bool) or not (
        isinstance(host_bandwidth, (int, float)) and host_bandwidth > 0
    ):
        raise ValueError(
            f"host_bandwidth must be a positive number of bytes/s, got {host_bandwidth!r}"
        )
    if host_memory_limit is not None and not host_memory_limit > 0:
        raise ValueError(
            f"host_memory_limit must be a positive number of bytes, got {host_memory_limit!r}"
        )


def _silent(message: str) -> None:
    """Progress nobody asked for."""


def _checked_schedules(schedules: Sequence[str] | None) -> tuple[str, ...]:
    """The requested schedule names, validated."""
    if isinstance(schedules, str):
        schedules = (schedules,)
    if schedules is None:
        return tuple(name for name in names() if spec(name).planned_by_default)
    unknown = [name for name in schedules if name not in names()]
    if unknown or not schedules:
        raise ValueError(
            f"schedules {list(schedules)!r} must be a non-empty choice of {', '.join(names())}"
        )
    return tuple(schedules)


def _microbatch_counts(microbatches: Sequence[int], batch_size: int | None) -> list[int]:
    """Micro-batch counts to try: the requested ones (that divide ``batch_size`` if given)."""
    if isinstance(microbatches, int):
        microbatches = (microbatches,)
    if not microbatches or any(
        isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in microbatches
    ):
        raise ValueError(f"microbatches must be positive integers, got {microbatches!r}")
    if batch_size is None:
        return sorted(set(microbatches))
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    counts = sorted(m for m in set(microbatches) if batch_size % m == 0)
    if not counts:
        raise ValueError(
            f"none of the micro-batch counts {sorted(set(microbatches))} divides "
            f"batch_size={batch_size}; give counts that divide it"
        )
    return counts


def _no_fit_message(
    memory_limit: float | None,
    smallest: tuple[float, Candidate | None],
    profile: Profile,
    topology: Topology,
    replication: bool,
    hosted: bool,
) -> str:
    """Why nothing was chosen, and which knobs would help (``hosted``: a family whose
    weights live in a host store was among those tried)."""
    need, candidate = smallest
    if candidate is None:
        reason = (
            "replication=False needs at least one layer per rank"
            if not replication
            else "no schedule can run it"
        )
        return (
            f"no candidate plan for {len(profile.layers)} layers on "
            f"{counted(topology.workers, 'rank')}: {reason}; use fewer ranks, replication=True, "
            "or other schedules"
        )
    return (
        f"no candidate plan fits a memory limit of {format_bytes(memory_limit or 0.0)} a rank "
        f"(memory_limit, pipetrain plan --worker-memory); the smallest needs "
        f"{math.ceil(need)} bytes "
        f"({format_bytes(need)}: {candidate.schedule}, "
        f"{counted(candidate.microbatches, 'micro-batch', 'micro-batches')}, recomputation "
        f"{candidate.recompute}, the cheapest that fits it). Raise the limit to at least that, "
        "or make each rank hold less: more micro-batches for the same batch size (smaller "
        "micro-batches hold less activation memory), or more ranks (fewer layers and weights "
        "each)"
        + (
            "."
            if hosted
            else ", or schedules=['roundpipe'], whose workers hold a few stages at a time "
            "from a host store."
        )
    )
