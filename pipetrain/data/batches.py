"""A batch of documents as micro-batches of padded tensors for a causal language model.

Each micro-batch is padded to its own longest document (not the batch's): inputs with
``pad_id``, labels (the inputs themselves, which :func:`pipetrain.causal_lm_loss` shifts)
with ``ignore_index`` where there is no token, so padding is never counted in the loss and,
padded on the right under causal attention, changes no real token's output.

Micro-batches are formed either as a fixed count of consecutive groups, or by a token
budget (:func:`token_budget_groups`): then their number follows the batch's lengths.
Documents can also be packed several to a row (:func:`packed`), each position labelled
with its document so that a model keeps attention and positions within it; for a Hugging
Face causal LM, :func:`packed_positions` labels them by ``position_ids`` instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipetrain.checks import positive_int

IGNORE_INDEX = -100


def fixed_groups(documents: int, count: int) -> list[list[int]]:
    """``documents`` indices in ``count`` consecutive groups whose sizes differ by at most
    one, the larger first (as :func:`torch.tensor_split` splits a batch)."""
    positive_int("count", count)
    if documents < count:
        raise ValueError(
            f"a batch of {documents} documents is smaller than {count} micro-batches; "
            "use a larger batch or fewer micro-batches"
        )
    size, extra = divmod(documents, count)
    bounds = [k * size + min(k, extra) for k in range(count + 1)]
    return [list(range(bounds[k], bounds[k + 1])) for k in range(count)]


def token_budget_groups(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of ``lengths`` in groups whose padded cost (rows x their longest length)
    stays within ``budget`` tokens: the longest first, each group filled while the next
    still fits (a document longer than the budget makes a group of its own). Groups come
    longest first; the same lengths always give the same groups."""
    positive_int("budget", budget)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for index in order:
        group = groups[-1] if groups else None
        # sorted longest first, so a group's first document sets its padded length
        if group is not None and (len(group) + 1) * lengths[group[0]] <= budget:
            group.append(index)
        else:
            groups.append([index])
    return groups


def padded(
    documents: Sequence[Sequence[int]], pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``documents`` as ``(inputs, labels)``, int64 ``[rows, longest]``: inputs padded with
    ``pad_id``, labels equal to the inputs and ``IGNORE_INDEX`` on the padding."""
    if not documents or not all(documents):
        raise ValueError("padded needs at least one document, each of at least one token")
    longest = max(len(d) for d in documents)
    labels = torch.full((len(documents), longest), IGNORE_INDEX, dtype=torch.int64)
    for row, document in enumerate(documents):
        labels[row, : len(document)] = torch.as_tensor(document, dtype=torch.int64)
    inputs = labels.masked_fill(labels == IGNORE_INDEX, pad_id)
    return inputs, labels


def microbatches(
    documents: Sequence[Sequence[int]],
    *,
    count: int | None = None,
    budget: int | None = None,
    pad_id: int = 0,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A batch's ``documents`` as micro-batches, each ``(inputs, labels)`` padded to its
    own longest: ``count`` consecutive groups, or groups within a ``budget`` of tokens."""
    if (count is None) == (budget is None):
        raise ValueError("give either count (micro-batches) or budget (tokens), not both")
    if count is not None:
        groups = fixed_groups(len(documents), count)
    else:
        assert budget is not None
        groups = token_budget_groups([len(d) for d in documents], budget)
    return [padded([documents[i] for i in group], pad_id) for group in groups]


def pack_groups(lengths: Sequence[int], capacity: int, rows: int = 1) -> list[list[int]]:
    """Indices of ``lengths`` packed into rows of at most ``capacity`` tokens, first fit in
    order of decreasing length (a document longer than ``capacity`` takes a row alone); the
    row of most documents is halved until there are at least ``rows``. The same lengths
    always give the same rows. ValueError when too few documents make ``rows`` rows."""
    positive_int("capacity", capacity)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    packed: list[list[int]] = []
    room: list[int] = []
    for index in order:
        fits = next((r for r, left in enumerate(room) if lengths[index] <= left), None)
        if fits is None:
            packed.append([index])
            room.append(capacity - lengths[index])
        else:
            packed[fits].append(index)
            room[fits] -= lengths[index]
    while len(packed) < rows:
        fullest = max(range(len(packed)), key=lambda r: (len(packed[r]), -r))
        if len(packed[fullest]) < 2:
            raise ValueError(
                f"{len(lengths)} documents make {len(packed)} packed rows, fewer than the "
                f"{rows} micro-batches; give a larger batch or fewer micro-batches"
            )
        half = len(packed[fullest]) // 2
        packed[fullest : fullest + 1] = [packed[fullest][:half], packed[fullest][half:]]
    return packed


def packed(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], capacity: int, rows: int = 1
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Documents given as ``(inputs, targets)`` 1-D pairs, packed into rows of at most
    ``capacity`` tokens (:func:`pack_groups`): ``((tokens, documents), targets)``, each
    ``[rows, longest row]``. ``documents`` numbers each position's document within its row
    (-1 on padding), for a model to restart positions and keep attention inside a
    document; padding has token 0 and target ``IGNORE_INDEX``."""
    groups = pack_groups([len(x) for x, _ in pairs], capacity, rows)
    width = max(sum(len(pairs[i][0]) for i in group) for group in groups)
    tokens = torch.zeros(len(groups), width, dtype=torch.int64)
    documents = torch.full((len(groups), width), -1, dtype=torch.int64)
    targets = torch.full((len(groups), width), IGNORE_INDEX, dtype=torch.int64)
    for row, group in enumerate(groups):
        start = 0
        for number, index in enumerate(group):
            inputs, wanted = pairs[index]
            stop = start + len(inputs)
            tokens[row, start:stop], targets[row, start:stop] = inputs, wanted
            documents[row, start:stop] = number
            start = stop
    return (tokens, documents), targets


def packed_positions(
    documents: Sequence[Sequence[int]], capacity: int, rows: int = 1, pad_id: int = 0
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``documents`` packed into rows of at most ``capacity`` tokens (:func:`pack_groups`)
    for a Hugging Face causal LM: ``({"input_ids", "position_ids"}, labels)``, each
    ``[rows, longest row]``. Positions restart at 0 at each document (and at the padding),
    which transformers' mask builder reads as packed sequences when neither an
    ``attention_mask`` nor a key-value cache is given, so attention stays within a
    document: capture the model with ``position_ids`` among its example inputs (a capture
    runs without a cache; an eager call needs ``use_cache=False``). Labels are the tokens,
    ``IGNORE_INDEX`` on each document's first token (which the previous document's last
    must not predict) and on the padding."""
    if not documents or not all(documents):
        raise ValueError("packed_positions needs at least one document, each of one token")
    pairs = [(torch.as_tensor(d, dtype=torch.int64),) * 2 for d in documents]
    (tokens, numbers), labels = packed(pairs, capacity, rows)
    labels[document_starts(numbers)] = IGNORE_INDEX
    tokens = tokens.masked_fill(numbers < 0, pad_id)
    return {"input_ids": tokens, "position_ids": document_positions(numbers)}, labels


def document_starts(documents: torch.Tensor) -> torch.Tensor:
    """Where each document of packed rows (``documents`` as :func:`packed` numbers them)
    begins, the padding counted as one: bool, the shape of ``documents``."""
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return starts


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Each position's offset within its document (:func:`document_starts`)."""
    positions = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    first = torch.where(document_starts(documents), positions, 0).cummax(dim=1).values
    return positions - first
