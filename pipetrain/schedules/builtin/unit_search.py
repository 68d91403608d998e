"""The search over candidate orders at unit costs: each candidate's peak per rank and span,
and the shortest within a cap.

A candidate's span is its longest rank span (first start to last end) when every F, B and
W takes one unit and each runs as soon as its rank's previous pass and its input (the
neighbouring stage's pass) are done. Timing a candidate is most of a search's work, so
:func:`shortest` stops timing one as soon as it cannot beat the best so far (each rank's
passes still to run take a unit each), and takes a list schedule's span from the schedule
itself where that is exact; ``exhaustive`` times every candidate in full instead (the same
answer, which the tests check).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pipetrain.schedules.builtin.unit_time import Coded, Coder, Trial


def coded_peaks(orders: Sequence[Sequence[int]], coder: Coder) -> list[int]:
    """Per rank, the most chunk micro-batches held at once: from a forward to its W."""
    forward_end = coder.stages * coder.microbatches
    weight_start = 2 * forward_end
    peaks = []
    for order in orders:
        held = peak = 0
        for code in order:
            if code < forward_end:
                held += 1
                if held > peak:
                    peak = held
            elif code >= weight_start:
                held -= 1
        peaks.append(peak)
    return peaks


def unit_span(
    orders: Sequence[Sequence[int]], coder: Coder, beyond: int | None = None
) -> int | None:
    """The longest rank span at unit costs; ``None`` if some rank waits for ever, or once
    some rank's span must exceed ``beyond``. A rank runs until its next pass's input is
    missing, and the pass that provides it puts the rank back to work."""
    m = coder.microbatches
    forward_end = coder.stages * m
    backward_end = 2 * forward_end
    done = [0] * (3 * forward_end)  # end time of each pass, 0 while it has not run
    waiter = [-1] * (3 * forward_end)  # the rank waiting for each pass to end
    position, clock = [0] * len(orders), [0] * len(orders)
    work = list(range(len(orders)))
    while work:
        rank = work.pop()
        order = orders[rank]
        index, now, length = position[rank], clock[rank], len(order)
        while index < length:
            code = order[index]
            if code < forward_end:
                needed = code - m
            elif code < backward_end:
                needed = code + m if code + m < backward_end else -1
            else:
                needed = -1
            if needed >= 0:
                ready = done[needed]
                if not ready:
                    waiter[needed] = rank
                    break
                if ready > now:
                    now = ready
            now += 1
            done[code] = now
            if waiter[code] >= 0:
                work.append(waiter[code])
            index += 1
        position[rank], clock[rank] = index, now
        # the passes left take a unit each at least
        if beyond is not None and index and now - done[order[0]] + 1 + length - index > beyond:
            return None
    if any(at < len(order) for at, order in zip(position, orders)):
        return None
    return max((end - done[order[0]] + 1 if order else 0 for end, order in zip(clock, orders)))


def shortest(
    candidates: Iterable[Trial | None], cap: Sequence[int], coder: Coder, exhaustive: bool = False
) -> Coded:
    """The candidate with the shortest :func:`unit_span` (then the smallest peak; then the
    first) among those holding at most ``cap[r]`` on every rank ``r``. The candidates are
    taken in turn, and the first with no bubble (a span of its busiest rank's pass count)
    ends the search, so an iterator of them is built only as far as needed. ``exhaustive``
    times each candidate in full, even a list schedule's span it knows already: the same
    answer, for checking that."""
    best: tuple[int, int, Coded] | None = None
    for trial in candidates:
        if trial is None:
            continue
        peaks = coded_peaks(trial.orders, coder)
        if any(peak > limit for peak, limit in zip(peaks, cap)):
            continue
        if exhaustive or trial.span is None:
            # a candidate that cannot beat the best's span loses: it is timed only so far
            beyond = None if exhaustive or best is None else best[0]
            span = unit_span(trial.orders, coder, beyond)
        else:
            span = trial.span
        if span is None:
            continue
        key = (span, max(peaks))
        if best is None or key < best[:2]:
            best = (*key, trial.orders)
        if span == max(len(order) for order in trial.orders):
            break
    if best is None:
        raise ValueError(f"no order holds at most {list(cap)} micro-batches per rank")
    return best[2]
