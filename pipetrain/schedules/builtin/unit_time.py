"""Split-backward orders for ranks holding several model stages, found under unit costs.

The zero-bubble families with chunks (``zb-v``, ``v-half``, ``v-min``, ``interleaved-zb``)
each cap the chunk micro-batches a rank holds (from the start of a forward to the end of its
weight pass) and want the shortest step under that cap with F = B = W = 1. This module
gives them the pieces, on orders written as integer codes (:class:`Coder`: a pass of
``stages`` stages and ``microbatches`` micro-batches is one int), which the search makes by
the hundred thousand:

- :func:`list_schedules`: list scheduling one time unit at a time. A rank runs a ready B
  first (the lowest stage: the nearest to finishing its micro-batch), else the highest
  ready forward its cap allows, else its oldest deferred W. With ``reserve``, a
  micro-batch's first forward on a rank takes a slot for every stage the rank holds, so
  its later forwards there never wait for memory and the order cannot stall (a micro-batch
  that has reached the last rank needs no more slots anywhere, so the oldest in flight
  always finishes and frees its slots); without it only the micro-batches held count,
  which packs more in but can stall;
- :func:`with_deferred_weights`: an existing order of forwards and backwards with each
  backward's weight pass moved into the gaps, as zero bubble does with 1F1B;
- :func:`repeated_block`: a building block (each stage's F, B and W at a fixed time)
  repeated every :data:`PERIOD` units, one micro-batch per period, in the order of those
  times;
- :func:`peak_held`: an order's peak per rank, which its order alone fixes;
- :func:`shortest` (in :mod:`~pipetrain.schedules.builtin.unit_search`): the shortest
  candidate that finishes within the cap.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

from pipetrain.schedules.actions import Action, Kind, shared_ints

Orders = list[list[Action]]
"""Each rank's F, B and W actions in order."""

Coded = list[list[int]]
"""Each rank's F, B and W passes in order, as :class:`Coder` codes."""

Found = tuple[tuple[int, ...], ...]
"""An order a search found, as codes; kept by the families' caches, so not to be changed."""

Block = Mapping[tuple[Kind, int], int]
"""A building block: the time unit of each (kind, stage) for micro-batch 0."""

PERIOD = 6
"""Units between micro-batches in a repeated block: a rank's F, B and W of its two stages."""

_NEVER = 1 << 62
_KINDS = (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT)


class Coder(NamedTuple):
    """Passes of ``stages`` stages and ``microbatches`` micro-batches as ints: forwards
    first, then backwards, then weight passes, each by stage, then micro-batch; so the
    forward a forward needs is ``code - microbatches`` and the backward a backward needs
    ``code + microbatches``."""

    stages: int
    microbatches: int

    def code(self, kind: Kind, stage: int, microbatch: int) -> int:
        """The code of one pass."""
        return (_KINDS.index(kind) * self.stages + stage) * self.microbatches + microbatch

    def encode(self, orders: Sequence[Sequence[Action]]) -> Coded:
        """``orders`` (F, B and W actions) as codes."""
        code = self.code
        return [[code(a.kind, a.stage, a.microbatch or 0) for a in order] for order in orders]

    def decode(self, orders: Sequence[Sequence[int]]) -> Orders:
        """Codes back as actions."""
        m, size = self.microbatches, self.stages * self.microbatches
        numbers = shared_ints(max(m, self.stages))
        return [
            [Action(_KINDS[c // size], numbers[c % size // m], numbers[c % m]) for c in order]
            for order in orders
        ]


class Trial(NamedTuple):
    """A candidate order, with its unit span where the generator knows it (a list schedule
    whose cap never held a pass back is its own as-soon-as-possible timing)."""

    orders: Coded
    span: int | None = None


def list_schedules(
    stage_rank: Sequence[int], microbatches: int, cap: Sequence[int], both: bool = False
) -> Iterator[Trial]:
    """:func:`list_schedule` with ``reserve``, then without it, unless reserving never held
    a forward back (the two orders are then the same) and ``both`` is false."""
    reserved = list_schedule(stage_rank, microbatches, cap, reserve=True)
    if reserved is not None:
        yield reserved
    if both or reserved is None or reserved.span is None:
        unreserved = list_schedule(stage_rank, microbatches, cap, reserve=False)
        if unreserved is not None:
            yield unreserved


def list_schedule(
    stage_rank: Sequence[int], microbatches: int, cap: Sequence[int], reserve: bool
) -> Trial | None:
    """List-schedule F, B and W of every stage (run by rank ``stage_rank[s]``) at unit
    costs, holding at most ``cap[r]`` chunk micro-batches on rank ``r``; ``None`` if it
    stalls. The trial's span is the schedule's own where the cap never held a ready forward
    back while its rank had no backward to run (then no pass could have started sooner).

    Each unit, only the ranks that may act are looked at: those that acted in the previous
    unit, and those whose neighbour then ran the pass they take next. Any other rank finds
    what it found before, so it would wait again."""
    ranks, stages, m = len(cap), len(stage_rank), microbatches
    held = [[s for s in range(stages) if stage_rank[s] == r] for r in range(ranks)]
    # per stage: its first code, and the ranks of the stages before and after it (-1: none)
    base = [stage * m for stage in range(stages)]
    before = [stage_rank[stage - 1] if stage else -1 for stage in range(stages)]
    after = [stage_rank[stage + 1] if stage < stages - 1 else -1 for stage in range(stages)]
    # end time of each stage's forward and backward of each micro-batch, at s·m + k
    forward_done, backward_done = [_NEVER] * (stages * m), [_NEVER] * (stages * m)
    backward_done += [0] * m  # the last stage's backward needs no later one
    next_forward, next_backward = [0] * stages, [0] * stages
    deferred: list[deque[int]] = [deque() for _ in range(ranks)]
    entered = [bytearray(m) for _ in range(ranks)]
    used = [0] * ranks
    orders: Coded = [[] for _ in range(ranks)]
    first, end = [-1] * ranks, [0] * ranks
    left = sum(3 * m * len(mine) for mine in held)
    to_backward, to_weight = stages * m, 2 * stages * m  # from a forward's code
    exact = True
    time = 0
    active = list(range(ranks))
    while left:
        woken: list[int] = []
        marked = bytearray(ranks)
        for rank in active:
            mine, order = held[rank], orders[rank]
            for stage in mine:  # the lowest ready B
                k = next_backward[stage]
                at = base[stage] + k
                if (
                    k < next_forward[stage]
                    and forward_done[at] <= time
                    and backward_done[at + m] <= time
                ):
                    next_backward[stage] = k + 1
                    backward_done[at] = time + 1
                    deferred[rank].append(at + to_weight)
                    order.append(at + to_backward)
                    neighbour = before[stage]
                    if neighbour >= 0 and not marked[neighbour]:
                        marked[neighbour] = 1
                        woken.append(neighbour)
                    break
            else:
                chosen = -1
                for stage in mine:  # the highest ready F the cap allows
                    k = next_forward[stage]
                    if k >= m or (stage and forward_done[base[stage] - m + k] > time):
                        continue
                    need = (0 if entered[rank][k] else len(mine)) if reserve else 1
                    if used[rank] + need <= cap[rank]:
                        chosen = stage
                    else:
                        exact = False
                if chosen >= 0:
                    k = next_forward[chosen]
                    next_forward[chosen] = k + 1
                    forward_done[base[chosen] + k] = time + 1
                    if not reserve:
                        used[rank] += 1
                    elif not entered[rank][k]:
                        entered[rank][k] = 1
                        used[rank] += len(mine)
                    order.append(base[chosen] + k)
                    neighbour = after[chosen]
                    if neighbour >= 0 and not marked[neighbour]:
                        marked[neighbour] = 1
                        woken.append(neighbour)
                elif deferred[rank]:
                    used[rank] -= 1
                    order.append(deferred[rank].popleft())
                else:
                    continue
            if first[rank] < 0:
                first[rank] = time
            end[rank] = time + 1
            left -= 1
            if not marked[rank]:
                marked[rank] = 1
                woken.append(rank)
        if not woken:  # nothing ran now, so nothing ends later: no rank can ever move
            return None
        active = woken
        time += 1
    span = max(e - max(f, 0) for e, f in zip(end, first)) if exact else None
    return Trial(orders, span)


def with_deferred_weights(
    orders: Sequence[Sequence[Action]], stages: int, microbatches: int, cap: Sequence[int]
) -> Trial | None:
    """``orders`` (forwards and unsplit backwards) with each backward split: its B where the
    backward was, its W run at unit costs whenever the rank's next pass cannot start (its
    input is not there, or a forward would hold more than ``cap[r]``), and the W's still
    owed at the end; ``None`` if it stalls."""
    coder = Coder(stages, microbatches)
    passes = coder.encode(orders)
    ranks, m = len(passes), microbatches
    forward_end, backward_end = stages * m, 2 * stages * m
    done = [0] * (3 * stages * m)  # end time of each pass, 0 while it has not run
    position = [0] * ranks
    held = [0] * ranks
    deferred: list[deque[int]] = [deque() for _ in range(ranks)]
    result: Coded = [[] for _ in range(ranks)]
    time = 0
    while any(position[r] < len(passes[r]) for r in range(ranks)):
        acted = False
        for rank, order in enumerate(passes):
            if position[rank] < len(order):
                code = order[position[rank]]
                forward = code < forward_end
                needed = _input_of(code, m, forward_end, backward_end)
                ready = needed < 0 or 0 < done[needed] <= time
                if ready and (not forward or held[rank] < cap[rank]):
                    position[rank] += 1
                    done[code] = time + 1
                    if forward:
                        held[rank] += 1
                    else:
                        deferred[rank].append(code + stages * m)
                    result[rank].append(code)
                    acted = True
                    continue
            if deferred[rank]:
                held[rank] -= 1
                result[rank].append(deferred[rank].popleft())
                acted = True
        if not acted:
            return None
        time += 1
    for rank, owed in enumerate(deferred):
        result[rank] += owed
    return Trial(result)


def repeated_block(stage_rank: Sequence[int], microbatches: int, block: Block) -> Trial:
    """Each rank's actions in the order of their times when micro-batch ``k`` runs
    ``block`` shifted by ``k·PERIOD``; a rank's passes in ``block`` must fall on distinct
    times modulo :data:`PERIOD` (as :func:`~pipetrain.schedules.builtin.vshape.tight_block`
    places them), so that no two of its passes ever share a time."""
    stages, m = len(stage_rank), microbatches
    coder = Coder(stages, m)
    size = 3 * stages * m  # above every code: a pass sorts by time · size + code
    stride = PERIOD * size + 1  # from micro-batch k's pass to k + 1's
    by_rank: list[list[int]] = [[] for _ in range(max(stage_rank) + 1)]
    residues: list[set[int]] = [set() for _ in by_rank]
    for (kind, stage), offset in block.items():
        rank = stage_rank[stage]
        if offset % PERIOD in residues[rank]:
            raise ValueError("a rank's passes in a repeated block share a time modulo PERIOD")
        residues[rank].add(offset % PERIOD)
        start = offset * size + coder.code(kind, stage, 0)
        by_rank[rank] += range(start, start + m * stride, stride)
    for keys in by_rank:
        keys.sort()
    return Trial([[key % size for key in keys] for keys in by_rank])


def peak_held(orders: Sequence[Sequence[Action]], since: Kind = Kind.FORWARD) -> list[int]:
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


def _input_of(code: int, m: int, forward_end: int, backward_end: int) -> int:
    """The code of the pass on a neighbouring stage whose result a pass needs, or -1."""
    if code < forward_end:
        return code - m  # negative for the first stage's forwards
    if code < backward_end:
        return code + m if code + m < backward_end else -1
    return -1
