"""A step given as rows of their own lengths, formed into micro-batches on the ranks.

``train_step(Sequences(rows), Sequences(rows))`` gives a step's rows as 1-D tensors, each
as long as its sequence. They are grouped into micro-batches, a fixed count of consecutive
rows, or, with ``PipelineConfig(microbatch_tokens=K)``, by a token budget (longest first,
rows x their longest within ``K``: :func:`pipetrain.data.batches.token_budget_groups`), so
the count follows the step's lengths. Each micro-batch is padded to its own longest:
inputs with 0, targets with ``IGNORE_INDEX`` (-100, which :func:`pipetrain.causal_lm_loss`
does not count). The first input-stage rank tells every rank the step's count (one small
all-reduce a step), since ranks in the middle of the pipeline see no data.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from pipetrain.data.batches import IGNORE_INDEX, fixed_groups, token_budget_groups
from pipetrain.distributed.transport import Transport
from pipetrain.runtime.rank.batch import MicroBatches


class Sequences(tuple[torch.Tensor, ...]):
    """A step's rows as 1-D tensors, each of its own length; give the inputs and the
    targets (rows of the same lengths) this way, and every rank with data the same rows.
    ``groups``, lists of row indices that take in every row once, forms the micro-batches
    the caller chose (the same on every rank); by default the pipeline forms them."""

    groups: list[list[int]] | None

    def __new__(
        cls, rows: Sequence[torch.Tensor], groups: Sequence[Sequence[int]] | None = None
    ) -> Sequences:
        """The step's ``rows``, in order, and how they form micro-batches, if chosen."""
        if not rows or any(not isinstance(r, torch.Tensor) or r.dim() != 1 for r in rows):
            raise ValueError("Sequences needs at least one row, each a 1-D tensor")
        if any(len(r) == 0 for r in rows):
            raise ValueError("Sequences rows must hold at least one value each")
        made = super().__new__(cls, rows)
        made.groups = None if groups is None else [list(g) for g in groups]
        if made.groups is not None and (
            sorted(i for g in made.groups for i in g) != list(range(len(rows)))
            or not all(made.groups)
        ):
            raise ValueError(
                f"Sequences groups must take each of the {len(rows)} rows once, in groups "
                f"of at least one; got {made.groups}"
            )
        return made


def _grouped(rows: Sequences, groups: list[list[int]], pad: int) -> MicroBatches:
    return MicroBatches(
        [pad_sequence([rows[i] for i in g], batch_first=True, padding_value=pad) for g in groups]
    )


def split_to(groups: list[list[int]], count: int) -> list[list[int]]:
    """``groups`` with the one of most rows (the first of those) halved until there are
    ``count``; ValueError when no group has two rows left to part."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        largest = max(range(len(groups)), key=lambda k: (len(groups[k]), -k))
        group = groups[largest]
        if len(group) < 2:
            raise ValueError(
                f"the schedule needs {count} micro-batches but the step has only "
                f"{len(groups)} rows; give larger batches"
            )
        half = (len(group) + 1) // 2
        groups[largest : largest + 1] = [group[:half], group[half:]]
    return groups


def formed(
    inputs: Any,
    targets: Any,
    *,
    budget: int | None,
    count: int,
    chooses: bool,
    transport: Transport,
    runnable: Callable[[int], int] = int,
) -> tuple[Any, Any, int]:
    """The step's ``inputs`` and ``targets`` as padded :class:`MicroBatches` and their
    count: ``count`` consecutive groups, or groups within ``budget`` tokens, split further
    to the count ``runnable`` says the schedule runs (some families need a multiple of the
    ranks); the rank that ``chooses``, the first input-stage rank, tells the others the
    count. Data not given as :class:`Sequences` is returned as it came without a budget;
    with one, every rank raises the same ValueError."""
    rows = next((v for v in (inputs, targets) if isinstance(v, Sequences)), None)
    groups = None
    if rows is not None:
        lengths = [len(r) for r in rows]
        if rows.groups is not None:
            groups = rows.groups
            if budget is None and len(groups) != count:
                raise ValueError(
                    f"the step's rows come in {len(groups)} groups but the schedule plays "
                    f"{count} micro-batches; give {count} groups, or microbatch_tokens for "
                    "a count that changes"
                )
        elif budget is None:
            groups = fixed_groups(len(rows), count)
        else:
            groups = token_budget_groups(lengths, budget)
        if budget is not None:
            groups = split_to(groups, runnable(len(groups)))
    if budget is not None:
        agreed = torch.tensor([len(groups) if chooses and groups else 0], device=transport.device)
        transport.all_reduce(agreed)
        if int(agreed) == 0:
            raise ValueError(
                "microbatch_tokens forms each step's micro-batches from its rows' lengths: give "
                "the first stage's ranks the inputs (and the last stage's the targets) as "
                "pipetrain.runtime.Sequences"
            )
        count = int(agreed)
        if groups is not None and len(groups) != count:
            raise ValueError(
                f"this rank formed {len(groups)} micro-batches but the first stage {count}: "
                "give every rank the same rows"
            )
    if groups is None:
        return inputs, targets, count
    if isinstance(inputs, Sequences):
        inputs = _grouped(inputs, groups, 0)
    if isinstance(targets, Sequences):
        targets = _grouped(targets, groups, IGNORE_INDEX)
    return inputs, targets, count
