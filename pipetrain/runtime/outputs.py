"""A step's last-stage outputs, put together and handed to the ranks that asked for them.

After a run, the last stage's outputs lie by micro-batch on the ranks that computed them
(evaluation gathers them all on the first last-stage rank; a replicated last stage in
training keeps each replica's own). :func:`deliver` gathers them on the first last-stage
rank, concatenates them in micro-batch order (a value per micro-batch, such as a model's
own loss, becomes its mean over the samples), and sends the whole batch's outputs to every
rank or to the one asked, as messages of the transport (shapes and dtypes travel with them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from pipetrain.distributed.transport import Tensors, Transport
from pipetrain.schedules.messages import rank_of

RESULTS = ("R", 0)
"""The channel outputs travel on, apart from every schedule's channels."""

Destination = str | int
"""``"all"`` (every rank of the group), or the group rank that gets the outputs."""


def check_destination(to: Destination, world: int) -> None:
    """ValueError unless ``to`` is ``"all"`` or a rank of a group of ``world`` ranks."""
    if to == "all":
        return
    if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < world:
        raise ValueError(f'to must be "all" or a rank in 0..{world - 1}, got {to!r}')


def deliver(
    transport: Transport,
    rank: int,
    world: int,
    stage_ranks: Sequence[Sequence[int]],
    microbatches: int,
    outputs: Mapping[int, Tensors],
    to: Destination,
) -> Tensors | None:
    """The whole batch's outputs (each tensor concatenated over the micro-batches) on the
    ranks ``to`` names, ``None`` elsewhere. ``outputs`` are this rank's, by micro-batch.
    Every rank of the group calls it with the same ``to``."""
    last = len(stage_ranks) - 1
    gather = stage_ranks[last][0]
    if rank in stage_ranks[last][1:]:
        for microbatch in sorted(outputs):
            transport.send(outputs[microbatch], gather, RESULTS)
    whole: Tensors | None = None
    if rank == gather:
        pieces = [
            outputs[k]
            if k in outputs
            else transport.receive(rank_of(stage_ranks, last, k), RESULTS)
            for k in range(microbatches)
        ]
        whole = _whole(pieces)
        receivers = [r for r in range(world) if r != gather] if to == "all" else [to]
        for receiver in receivers:
            if receiver != gather:
                transport.send(whole, int(receiver), RESULTS)
    elif to in ("all", rank):
        whole = transport.receive(gather, RESULTS)
    transport.flush()
    return whole if to in ("all", rank) else None


def _whole(pieces: Sequence[Tensors]) -> Tensors:
    """The micro-batches' outputs as the whole batch's: each tensor concatenated, and a
    zero-dimensional one (a mean over its micro-batch, such as a model's own loss)
    averaged with each micro-batch weighted by its rows (those of its first output that
    has rows)."""
    rows = [next((len(t) for t in piece if t.dim() > 0), 1) for piece in pieces]
    whole = []
    for parts in zip(*pieces):
        if parts[0].dim() > 0:
            whole.append(torch.cat(parts))
        elif parts[0].is_floating_point():
            weighted = sum(part * count for part, count in zip(parts, rows, strict=True))
            whole.append(torch.as_tensor(weighted) / sum(rows))
        else:
            whole.append(torch.stack(parts))
    return tuple(whole)
