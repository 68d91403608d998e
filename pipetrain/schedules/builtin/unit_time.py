"""Split-backward orders for ranks holding several model stages, found under unit costs.

The zero-bubble families with chunks (``zb-v``, ``v-half``, ``v-min``, ``interleaved-zb``)
each cap the chunk micro-batches a rank holds (from the start of a forward to the end of its
weight pass) and want the shortest step under that cap with F = B = W = 1. This module
gives them the pieces:

- :func:`list_schedule`: list scheduling one time unit at a time. A rank runs a ready B
  first (the lowest stage: the nearest to finishing its micro-batch), else the highest
  ready forward its cap allows, else its oldest deferred W. With ``reserve``, a
  micro-batch's first forward on a rank takes a slot for every stage the rank holds, so
  its later forwards there never wait for memory and the order cannot stall (a micro-batch
  that has reached the last rank needs no more slots anywhere, so the oldest in flight
  always finishes and frees its slots); without it only the micro-batches held count,
  which packs more in but can stall (``None``);
- :func:`with_deferred_weights`: an existing order of forwards and backwards with each
  backward's weight pass moved into the gaps, as zero bubble does with 1F1B;
- :func:`repeated_block`: a building block (each stage's F, B and W at a fixed time)
  repeated every :data:`PERIOD` units, one micro-batch per period, in the order of those
  times;
- :func:`peak_held`: a candidate's peak per rank, which its order alone fixes;
- :func:`unit_span`: its longest rank span (first start to last end) at unit costs, or
  ``None`` where the order would wait for ever;
- :func:`shortest`: the shortest candidate that finishes within the cap.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from pipetrain.schedules.actions import Action, Kind

Orders = list[list[Action]]
"""Each rank's F, B and W actions in order."""

Block = dict[tuple[Kind, int], int]
"""A building block: the time unit of each (kind, stage) for micro-batch 0."""

PERIOD = 6
"""Units between micro-batches in a repeated block: a rank's F, B and W of its two stages."""

_NEVER = 1 << 62


def list_schedule(
    stage_rank: Sequence[int], microbatches: int, cap: Sequence[int], reserve: bool
) -> Orders | None:
    """List-schedule F, B and W of every stage (run by rank ``stage_rank[s]``) at unit
    costs, holding at most ``cap[r]`` chunk micro-batches on rank ``r``; ``None`` if it
    stalls."""
    ranks, stages, m = len(cap), len(stage_rank), microbatches
    held = [[s for s in range(stages) if stage_rank[s] == r] for r in range(ranks)]
    forward_done: dict[tuple[int, int], int] = {}
    backward_done: dict[tuple[int, int], int] = {}
    next_forward, next_backward = [0] * stages, [0] * stages
    deferred: list[deque[tuple[int, int]]] = [deque() for _ in range(ranks)]
    entered: list[set[int]] = [set() for _ in range(ranks)]
    used = [0] * ranks
    orders: Orders = [[] for _ in range(ranks)]
    total = [3 * m * len(mine) for mine in held]
    time = 0
    while any(len(orders[r]) < total[r] for r in range(ranks)):
        acted = False
        for rank, mine in enumerate(held):
            ready_b = [
                s
                for s in mine
                if next_backward[s] < next_forward[s]
                and forward_done[(s, next_backward[s])] <= time
                and (
                    s == stages - 1 or backward_done.get((s + 1, next_backward[s]), _NEVER) <= time
                )
            ]
            ready_f = []
            for s in mine:
                k = next_forward[s]
                if k >= m or (s > 0 and forward_done.get((s - 1, k), _NEVER) > time):
                    continue
                need = (0 if k in entered[rank] else len(mine)) if reserve else 1
                if used[rank] + need <= cap[rank]:
                    ready_f.append(s)
            if ready_b:
                stage = min(ready_b)
                k = next_backward[stage]
                next_backward[stage] += 1
                backward_done[(stage, k)] = time + 1
                deferred[rank].append((stage, k))
                orders[rank].append(Action(Kind.BACKWARD, stage, k))
            elif ready_f:
                stage = max(ready_f)
                k = next_forward[stage]
                next_forward[stage] += 1
                forward_done[(stage, k)] = time + 1
                if not reserve:
                    used[rank] += 1
                elif k not in entered[rank]:
                    entered[rank].add(k)
                    used[rank] += len(mine)
                orders[rank].append(Action(Kind.FORWARD, stage, k))
            elif deferred[rank]:
                stage, k = deferred[rank].popleft()
                used[rank] -= 1
                orders[rank].append(Action(Kind.WEIGHT, stage, k))
            else:
                continue
            acted = True
        if not acted:  # nothing runs now, so nothing ends later: no rank can ever move
            return None
        time += 1
    return orders


def with_deferred_weights(
    orders: Sequence[Sequence[Action]], stages: int, cap: Sequence[int]
) -> Orders | None:
    """``orders`` (forwards and unsplit backwards) with each backward split: its B where the
    backward was, its W run at unit costs whenever the rank's next pass cannot start (its
    input is not there, or a forward would hold more than ``cap[r]``), and the W's still
    owed at the end; ``None`` if it stalls."""
    ranks = len(orders)
    done: dict[tuple[Kind, int, int], int] = {}
    position = [0] * ranks
    held = [0] * ranks
    deferred: list[deque[tuple[int, int]]] = [deque() for _ in range(ranks)]
    result: Orders = [[] for _ in range(ranks)]
    time = 0
    while any(position[r] < len(orders[r]) for r in range(ranks)):
        acted = False
        for rank, order in enumerate(orders):
            if position[rank] < len(order):
                kind, stage, mb, _, _ = order[position[rank]]
                assert mb is not None
                needed = _input_of(kind, stage, mb, stages)
                ready = needed is None or done.get(needed, _NEVER) <= time
                if ready and (kind is not Kind.FORWARD or held[rank] < cap[rank]):
                    position[rank] += 1
                    done[(kind, stage, mb)] = time + 1
                    if kind is Kind.FORWARD:
                        held[rank] += 1
                    else:
                        deferred[rank].append((stage, mb))
                    result[rank].append(Action(kind, stage, mb))
                    acted = True
                    continue
            if deferred[rank]:
                stage, mb = deferred[rank].popleft()
                held[rank] -= 1
                result[rank].append(Action(Kind.WEIGHT, stage, mb))
                acted = True
        if not acted:
            return None
        time += 1
    for rank, owed in enumerate(deferred):
        result[rank] += [Action(Kind.WEIGHT, stage, mb) for stage, mb in owed]
    return result


def repeated_block(stage_rank: Sequence[int], microbatches: int, block: Block) -> Orders:
    """Each rank's actions in the order of their times when micro-batch ``k`` runs
    ``block`` shifted by ``k·PERIOD``."""
    timed = sorted(
        (offset + PERIOD * k, kind is not Kind.FORWARD, stage, kind, k)
        for k in range(microbatches)
        for (kind, stage), offset in block.items()
    )
    orders: Orders = [[] for _ in range(max(stage_rank) + 1)]
    for _, _, stage, kind, k in timed:
        orders[stage_rank[stage]].append(Action(kind, stage, k))
    return orders


def peak_held(orders: Orders, since: Kind = Kind.FORWARD) -> list[int]:
    """Per rank, the most chunk micro-batches held at once: from a forward (or the pass
    ``since``) to its W."""
    peaks = []
    for order in orders:
        held = peak = 0
        for action in order:
            if action.kind is since:
                held += 1
                peak = max(peak, held)
            elif action.kind is Kind.WEIGHT:
                held -= 1
        peaks.append(peak)
    return peaks


def unit_span(orders: Orders, stages: int) -> int | None:
    """The longest rank span when every F, B and W takes one unit and each runs as soon as
    its rank's previous action and its input (the neighbouring stage's pass) are done;
    ``None`` if some rank waits for ever."""
    done: dict[tuple[Kind, int, int], int] = {}
    position, clock = [0] * len(orders), [0] * len(orders)
    first: list[int | None] = [None] * len(orders)
    moved = True
    while moved:
        moved = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                kind, stage, mb, _, _ = order[position[rank]]
                assert mb is not None
                needed = _input_of(kind, stage, mb, stages)
                if needed is not None and needed not in done:
                    break
                start = max(clock[rank], done[needed] if needed is not None else 0)
                first[rank] = start if first[rank] is None else first[rank]
                clock[rank] = done[(kind, stage, mb)] = start + 1
                position[rank] += 1
                moved = True
    if any(at < len(order) for at, order in zip(position, orders)):
        return None
    return max(end - (start or 0) for end, start in zip(clock, first))


def _input_of(kind: Kind, stage: int, mb: int, stages: int) -> tuple[Kind, int, int] | None:
    """The pass on a neighbouring stage whose result an action needs, if any."""
    if kind is Kind.FORWARD and stage > 0:
        return (Kind.FORWARD, stage - 1, mb)
    if kind is Kind.BACKWARD and stage < stages - 1:
        return (Kind.BACKWARD, stage + 1, mb)
    return None


def shortest(candidates: Iterable[Orders | None], cap: Sequence[int], stages: int) -> Orders:
    """The candidate with the shortest :func:`unit_span` (then the smallest peak) among
    those holding at most ``cap[r]`` on every rank ``r``. The candidates are taken in turn,
    and the first with no bubble (a span of its busiest rank's action count) ends the
    search, so an iterator of them is built only as far as needed."""
    best: tuple[int, int, Orders] | None = None
    for orders in candidates:
        if orders is None:
            continue
        peaks = peak_held(orders)
        if any(peak > limit for peak, limit in zip(peaks, cap)):
            continue
        span = unit_span(orders, stages)
        if span is None:
            continue
        key = (span, max(peaks))
        if best is None or key < best[:2]:
            best = (*key, orders)
        if span == max(len(order) for order in orders):
            break
    if best is None:
        raise ValueError(f"no order holds at most {list(cap)} micro-batches per rank")
    return best[2]
