"""DualPipeV (DeepSeek-V3's DualPipe folded into a V, as ``torch.distributed.pipelining``
writes it): two chunks per rank in a V, B and W apart, and in the steady phase each rank's
forward of one micro-batch overlapped (``OVERLAP``) with the backward of another."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from functools import lru_cache

from pipetrain.schedules.actions import Action, Kind, shared_ints
from pipetrain.schedules.builtin.unit_time import peak_held
from pipetrain.schedules.builtin.vshape import CHUNKS, check_v, v_placement
from pipetrain.schedules.registry import Generated, Option, Options, ScheduleSpec

FULL_BACKWARD = Option(
    "full_backward",
    False,
    "send a full backward's input gradient after its W, the two run as one pass (as "
    "torch.distributed.pipelining's DualPipeV runs them); by default it is sent after "
    "the input part, as the DualPipe paper counts its bubble",
)


def rank_order(ranks: int, rank: int, microbatches: int) -> list[Action]:
    """Rank ``r``'s passes, with ``c0 = r``, ``c1 = 2p − 1 − r`` and a full backward being
    B with its W at once: ``2(p − r − 1)`` F ``c0``; ``r + 1`` times F ``c0``, F ``c1``;
    ``p − r − 1`` times B ``c1`` (W deferred), the oldest deferred W, F ``c1``; then
    ``m − 2p + r + 1`` times F ``c0`` with ``c1``'s full backward and F ``c1`` with ``c0``'s,
    each pair overlapped (but the first on the last rank); ``p − r − 1`` times ``c1``'s
    full backward, then F ``c1`` overlapped with ``c0``'s; ``r + 1`` times the backwards of
    ``c1`` and ``c0``, full in the first half, W deferred after; ``p − r − 1`` times a
    deferred W and B ``c0``; and the deferred W's left."""
    p, m, c0, c1 = ranks, microbatches, rank, 2 * ranks - 1 - rank
    passes: list[tuple[Kind, int]] = []
    owed: deque[int] = deque()

    def forward(stage: int) -> None:
        passes.append((Kind.FORWARD, stage))

    def backward(stage: int, full: bool) -> None:
        passes.append((Kind.BACKWARD, stage))
        if full:
            passes.append((Kind.WEIGHT, stage))
        else:
            owed.append(stage)

    def weight() -> None:
        if owed:
            passes.append((Kind.WEIGHT, owed.popleft()))

    def overlapped(forward_stage: int, backward_stage: int) -> None:
        passes.append((Kind.OVERLAP, forward_stage))
        forward(forward_stage)
        backward(backward_stage, full=True)

    for _ in range(2 * (p - rank - 1)):
        forward(c0)
    for _ in range(rank + 1):
        forward(c0)
        forward(c1)
    for _ in range(p - rank - 1):
        backward(c1, full=False)
        weight()
        forward(c1)
    for i in range(m - 2 * p + rank + 1):
        if i == 0 and rank == p - 1:
            forward(c0)
            backward(c1, full=True)
        else:
            overlapped(c0, c1)
        overlapped(c1, c0)
    for _ in range(p - rank - 1):
        backward(c1, full=True)
        overlapped(c1, c0)
    split = False
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        backward(c1, full=not split)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        backward(c0, full=not split)
    for _ in range(p - rank - 1):
        weight()
        backward(c0, full=not split)
    while owed:
        weight()
    count: dict[tuple[Kind, int], int] = {}
    numbers = shared_ints(m)
    order = []
    for kind, stage in passes:
        if kind is Kind.OVERLAP:
            order.append(Action(kind, stage))
            continue
        k = count.get((kind, stage), 0)
        count[(kind, stage)] = k + 1
        order.append(Action(kind, stage, numbers[k]))
    return order


@lru_cache(maxsize=256)
def _orders(ranks: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    return tuple(tuple(rank_order(ranks, rank, microbatches)) for rank in range(ranks))


def generate(
    ranks: int, microbatches: int, replicas: Sequence[int] | None, options: Options
) -> Generated:
    """Every rank's :func:`rank_order`, then its two optimizer steps."""
    orders = [list(order) for order in _orders(ranks, microbatches)]
    for rank, order in enumerate(orders):
        order += [Action(Kind.STEP, rank), Action(Kind.STEP, 2 * ranks - 1 - rank)]
    return Generated(orders, [(v_placement(stage, ranks),) for stage in range(2 * ranks)])


def check(ranks: int, microbatches: int, replicas: Sequence[int] | None, options: Options) -> None:
    """Two chunks per rank, and at least as many micro-batches as model stages."""
    check_v("dualpipev")(ranks, microbatches, replicas, options)
    if microbatches < 2 * ranks:
        raise ValueError(
            f"dualpipev needs microbatches >= 2·ranks ({2 * ranks}), its model stages; "
            f"got {microbatches}"
        )


@lru_cache(maxsize=256)
def _peaks(ranks: int, microbatches: int) -> tuple[int, ...]:
    return tuple(peak_held([list(order) for order in _orders(ranks, microbatches)]))


def in_flight(stage: int, microbatches: int, replicas: Sequence[int], chunks: int) -> int:
    """Chunk micro-batches rank ``stage`` holds at once (until each W), read from the order."""
    return _peaks(len(replicas), microbatches)[stage]


SPEC = ScheduleSpec(
    name="dualpipev",
    summary="DualPipeV: two chunks per rank in a V, B and W apart, forwards overlapped "
    "with backwards",
    generate=generate,
    options=(CHUNKS, FULL_BACKWARD),
    check=check,
    chunk_option="virtual",
    placement=v_placement,
    split_backward=True,
    in_flight=in_flight,
    default_costs={"forward_s": 1.0, "backward_s": 1.0, "weight_s": 1.0},
    planned_by_default=True,
)
