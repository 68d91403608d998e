"""Insert the sends and receives that connect stages into per-rank compute orders.

Sends go right after the action that produced the tensor. Receives are placed so that on
every (sender, receiver) channel they come in the sender's order: backends such as NCCL
match point-to-point messages between a pair of ranks in order, and pre-posting receives
in that order is then always safe. A receive is moved no later than the first consumer of
any message sent after it on the same channel, which cannot introduce a deadlock: the
receiver has to wait for that later message at that point anyway, and it is sent after.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from pipetrain.schedules.actions import Action, Kind

# (kind, stage, microbatch) of a message, as the receiver's action names it
MessageKey = tuple[Kind, int, int]


def _placement(stage_ranks: Sequence[Sequence[int]]):
    def rank_of(stage: int, microbatch: int) -> int:
        replicas = stage_ranks[stage]
        return replicas[microbatch % len(replicas)]

    return rank_of


def connect(
    compute_orders: Sequence[Sequence[Action]], stage_ranks: Sequence[Sequence[int]]
) -> tuple[tuple[Action, ...], ...]:
    """Return full per-rank action lists: compute orders plus sends and receives."""
    rank_of = _placement(stage_ranks)
    num_stages = len(stage_ranks)
    num_ranks = len(compute_orders)

    with_sends: list[list[Action]] = []
    # incoming[receiver][sender] = [(message key, index of the consumer in receiver's compute order)]
    sent_order: dict[tuple[int, int], list[MessageKey]] = defaultdict(list)
    consumer_index: dict[int, dict[MessageKey, int]] = defaultdict(dict)

    for rank, order in enumerate(compute_orders):
        actions: list[Action] = []
        for index, action in enumerate(order):
            stage, mb = action.stage, action.microbatch
            if action.kind is Kind.FORWARD and stage > 0:
                source = rank_of(stage - 1, mb)
                if source != rank:
                    consumer_index[rank][(Kind.RECV_F, stage, mb)] = index
            if action.kind is Kind.BACKWARD and stage < num_stages - 1:
                source = rank_of(stage + 1, mb)
                if source != rank:
                    consumer_index[rank][(Kind.RECV_B, stage, mb)] = index
            actions.append(action)
            if action.kind is Kind.FORWARD and stage < num_stages - 1:
                target = rank_of(stage + 1, mb)
                if target != rank:
                    actions.append(Action(Kind.SEND_F, stage, mb, peer=target))
                    sent_order[(rank, target)].append((Kind.RECV_F, stage + 1, mb))
            if action.kind is Kind.BACKWARD and stage > 0:
                target = rank_of(stage - 1, mb)
                if target != rank:
                    actions.append(Action(Kind.SEND_B, stage, mb, peer=target))
                    sent_order[(rank, target)].append((Kind.RECV_B, stage - 1, mb))
        with_sends.append(actions)

    # receives_before[receiver][compute index] = receives to issue right before it
    receives_before: list[dict[int, list[Action]]] = [defaultdict(list) for _ in range(num_ranks)]
    for (sender, receiver), messages in sent_order.items():
        needs = [consumer_index[receiver].get(key) for key in messages]
        if any(need is None for need in needs):
            missing = messages[needs.index(None)]
            raise ValueError(
                f"rank {sender} sends {missing[0].value} stage {missing[1]} micro-batch "
                f"{missing[2]} to rank {receiver}, which never uses it"
            )
        earliest = len(compute_orders[receiver])
        slots = [0] * len(messages)
        for i in range(len(messages) - 1, -1, -1):
            earliest = min(earliest, needs[i])
            slots[i] = earliest
        for (kind, stage, mb), slot in zip(messages, slots):
            receives_before[receiver][slot].append(Action(kind, stage, mb, peer=sender))

    result = []
    for rank, actions in enumerate(with_sends):
        merged: list[Action] = []
        compute_index = 0
        for action in actions:
            if action.kind not in (Kind.SEND_F, Kind.SEND_B):
                merged.extend(receives_before[rank].get(compute_index, ()))
                compute_index += 1
            merged.append(action)
        result.append(tuple(merged))
    return tuple(result)
