"""Lowering: from the actions a schedule's author writes to every action a rank performs.

- :func:`lower` adds the sends and receives that connect stages, and the loss all-reduce
  that ends a training step;
- :func:`with_targets_shipped` adds the transfer of the step's targets from the input stage
  to the last stage;
- :func:`forward_only` keeps the forwards and gathers the last stage's outputs on one rank.

Sends go right after the action that produced the tensor (with ``full_backwards``, the
input gradient of a ``B`` written right before its own ``W`` after that ``W``: the two are
one full backward, which the runtime runs as one pass). Receives are placed so that on
every (sender, receiver) pair they come in the sender's order: backends such as NCCL match
point-to-point messages between a pair of ranks in order, and pre-posting receives in that
order is then always safe. A receive is moved no later than the first consumer of any
message sent after it on the same pair, which cannot introduce a deadlock: the receiver has
to wait for that later message at that point anyway, and it is sent after. Every pass is
linear in the number of actions.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from itertools import repeat
from operator import add

from pipetrain.schedules.actions import Action, Kind, trusted_action
from pipetrain.schedules.messages import HANDS_ON, NEEDS, RECEIVES
from pipetrain.schedules.overlap import pairs

Lanes = tuple[tuple[Action, ...], ...]


def lower(
    compute_orders: Sequence[Sequence[Action]],
    stage_ranks: Sequence[Sequence[int]],
    loss: bool = True,
    *,
    full_backwards: bool = False,
) -> Lanes:
    """Full per-rank action lists: the written actions, the transfers between stages that
    :data:`~pipetrain.schedules.messages.NEEDS` and
    :data:`~pipetrain.schedules.messages.HANDS_ON` call for and, with ``loss``, a closing
    ``LOSS`` on every rank (on the highest stage it holds)."""
    tables = _transfer_tables(stage_ranks)
    # sent[(sender, receiver)]: (receive kind, stage, micro-batch) in the sender's order
    sent: dict[tuple[int, int], list[tuple[Kind, int, int]]] = defaultdict(list)
    # consumer[rank][(receive kind, stage, micro-batch)]: index of the written action using it
    consumer: list[dict[tuple[Kind, int, int], int]] = [{} for _ in compute_orders]
    with_sends: list[list[Action]] = []
    # starts[rank][i]: where the i-th written action without a peer sits in with_sends
    starts: list[list[int]] = []
    for rank, order in enumerate(compute_orders):
        actions: list[Action] = []
        at: list[int] = []
        uses = consumer[rank]
        outboxes: dict[int, list[tuple[Kind, int, int]]] = {}  # sent[(rank, receiver)]
        paired = pairs(order)  # an overlapped backward takes its inputs when its pair starts
        deferred: list[Action] = []  # a full backward's send, due after its W
        for index, action in enumerate(order):
            kind, stage, mb, peer, _ = action
            if peer is None:
                at.append(len(actions))
            actions.append(action)
            if deferred:
                actions += deferred
                deferred.clear()
            table = tables.get(kind)
            if table is None or mb is None:
                continue
            entry = table.get(stage)
            if entry is None:
                entry = _transfers(kind, stage, stage_ranks)
            receive, sources, send, receive_there, target_stage, targets = entry
            if sources is not None and sources[mb % len(sources)] != rank:
                uses[(receive, stage, mb)] = paired.get(index, index) if paired else index
            if targets is not None:
                target = targets[mb % len(targets)]
                if target != rank:
                    full = full_backwards and weight_pass_of(
                        action, order[index + 1] if index + 1 < len(order) else None
                    )
                    (deferred if full else actions).append(
                        trusted_action((send, stage, mb, target, None))
                    )
                    outbox = outboxes.get(target)
                    if outbox is None:
                        outbox = outboxes[target] = sent[(rank, target)]
                    outbox.append((receive_there, target_stage, mb))
        with_sends.append(actions)
        starts.append(at)

    # each receiver's receives, and where each goes: before the action at that position of
    # with_sends (so before everything already there, in the order added)
    incoming: list[list[Action]] = [[] for _ in compute_orders]
    positions: list[list[int]] = [[] for _ in compute_orders]
    for (sender, receiver), receives in sent.items():
        slots = _slots(sender, receiver, receives, consumer[receiver])
        at = starts[receiver]
        if slots and slots[-1] >= len(at):  # a user at an index no action without a peer has
            kept = [i for i, slot in enumerate(slots) if slot < len(at)]
            receives, slots = [receives[i] for i in kept], [slots[i] for i in kept]
        positions[receiver] += map(at.__getitem__, slots)
        incoming[receiver] += map(trusted_action, map(add, receives, repeat((sender, None))))

    highest: dict[int, int] = {}  # the highest stage each rank holds
    for stage, holders in enumerate(stage_ranks):
        for rank in holders:
            highest[rank] = stage
    lanes = []
    for rank, actions in enumerate(with_sends):
        merged = _spliced(actions, incoming[rank], positions[rank])
        if loss:
            merged.append(Action(Kind.LOSS, highest.get(rank, 0)))
        lanes.append(tuple(merged))
    return tuple(lanes)


def _slots(
    sender: int,
    receiver: int,
    receives: list[tuple[Kind, int, int]],
    uses: dict[tuple[Kind, int, int], int],
) -> list[int]:
    """Before which of ``receiver``'s written actions each message from ``sender`` is
    received: its user's, or a later message's on the pair if that is used earlier (so the
    pair's receives come in the sender's order)."""
    users = list(map(uses.get, receives))
    if None in users:
        kind, stage, mb = receives[len(users) - 1 - users[::-1].index(None)]
        raise ValueError(
            f"rank {sender} sends {kind.value}{stage}.{mb} to rank {receiver}, which never uses it"
        )
    slots: list[int] = users  # type: ignore[assignment]  # no None, as just checked
    if slots != sorted(slots):  # messages used out of their order: each at its first user
        for i in range(len(slots) - 2, -1, -1):
            if slots[i + 1] < slots[i]:
                slots[i] = slots[i + 1]
    return slots


def _spliced(actions: list[Action], receives: list[Action], positions: list[int]) -> list[Action]:
    """``actions`` with each of ``receives`` before the action at its position (several
    before one in the order given), the runs of actions between copied in C."""
    merged: list[Action] = []
    done = 0
    for index in sorted(range(len(receives)), key=positions.__getitem__):  # stable
        position = positions[index]
        if position > done:
            merged += actions[done:position]
            done = position
        merged.append(receives[index])
    merged += actions[done:]
    return merged


Transfers = tuple[Kind, tuple[int, ...] | None, Kind, Kind, int, tuple[int, ...] | None]
"""What a compute action of one kind and stage exchanges: the receive kind it needs and the
ranks of the stage it needs it from (``None`` where that stage does not exist), the send
kind it hands its result on with, that send's receive kind, the consuming stage, and that
stage's ranks (``None`` where it does not exist)."""


def _transfers(kind: Kind, stage: int, stage_ranks: Sequence[Sequence[int]]) -> Transfers:
    """A compute action's :data:`Transfers` (``kind`` in :data:`NEEDS`)."""
    last = len(stage_ranks) - 1
    receive, _, source_offset = NEEDS[kind]
    send, target_offset = HANDS_ON[kind]
    source, target = stage + source_offset, stage + target_offset
    return (
        receive,
        tuple(stage_ranks[source]) if 0 <= source <= last else None,
        send,
        RECEIVES[send][0],
        target,
        tuple(stage_ranks[target]) if 0 <= target <= last else None,
    )


def _transfer_tables(stage_ranks: Sequence[Sequence[int]]) -> dict[Kind, dict[int, Transfers]]:
    """Each compute kind that exchanges data -> its :data:`Transfers` at every stage: looked
    up once per action instead of worked out (stages outside the placement are worked out
    where met)."""
    return {
        kind: {stage: _transfers(kind, stage, stage_ranks) for stage in range(len(stage_ranks))}
        for kind in NEEDS
    }


def full_backwards(options: Mapping[str, object]) -> bool:
    """Whether a schedule's ``full_backward`` option (or fact) makes a ``B`` written right
    before its own ``W`` one full backward (see :func:`lower`)."""
    return options.get("full_backward") is True


def weight_pass_of(backward: Action, following: Action | None) -> bool:
    """Whether ``following`` is the ``W`` of ``backward``, a ``B`` (same stage, micro-batch
    and weight version)."""
    return (
        backward.kind is Kind.BACKWARD
        and following is not None
        and following.kind is Kind.WEIGHT
        and following[1:] == backward[1:]
    )


def with_targets_shipped(lanes: Lanes, stage_ranks: Sequence[Sequence[int]]) -> Lanes:
    """``lanes`` with the step's targets sent from the first input-stage rank to every
    last-stage rank that does not hold the input stage too, before anything else, so only
    the input stage's ranks need to load data (a rank holding both reads its own)."""
    source, last = stage_ranks[0][0], len(stage_ranks) - 1
    sinks = [rank for rank in stage_ranks[-1] if rank not in stage_ranks[0]]
    shipped = []
    for rank, actions in enumerate(lanes):
        head: tuple[Action, ...] = ()
        if rank == source:
            head = tuple(Action(Kind.SEND_T, 0, None, sink) for sink in sinks)
        elif rank in sinks:
            head = (Action(Kind.RECV_T, last, None, source),)
        shipped.append(head + tuple(actions))
    return tuple(shipped)


def _forward_residencies(lane: list[Action]) -> list[Action]:
    """``lane`` without the ``LOAD``/``OFFLOAD`` pairs around no forward (a backward's)."""
    loaded: dict[int, int] = {}  # stage -> index of its LOAD in lane
    idle: set[int] = set()  # indices of dropped LOADs and OFFLOADs
    ran: set[int] = set()
    for index, action in enumerate(lane):
        if action.kind is Kind.LOAD:
            loaded[action.stage] = index
            ran.discard(action.stage)
        elif action.kind is Kind.FORWARD:
            ran.add(action.stage)
        elif action.kind is Kind.OFFLOAD and action.stage not in ran:
            idle.update((loaded[action.stage], index))
    return [action for index, action in enumerate(lane) if index not in idle]


def forward_only(lanes: Lanes, stage_ranks: Sequence[Sequence[int]]) -> Lanes:
    """The forwards and their transfers, on the newest weights, with every last-stage
    output gathered on the first rank of the last stage (for evaluation); a host-stored
    schedule keeps the ``LOAD`` and ``OFFLOAD`` around each stage's forwards."""
    last = len(stage_ranks) - 1
    gather = stage_ranks[last][0]
    keep = (Kind.FORWARD, Kind.SEND_F, Kind.RECV_F, Kind.LOAD, Kind.OFFLOAD)
    result: list[list[Action]] = []
    incoming: list[Action] = []
    for rank, actions in enumerate(lanes):
        kept: list[Action] = []
        for action in actions:
            if action.kind not in keep:
                continue
            kept.append(action._replace(version=None))
            if action.kind is Kind.FORWARD and action.stage == last and rank != gather:
                kept.append(Action(Kind.SEND_O, last, action.microbatch, gather))
                incoming.append(Action(Kind.RECV_O, last, action.microbatch, rank))
        result.append(_forward_residencies(kept))
    result[gather].extend(incoming)
    return tuple(tuple(actions) for actions in result)
