"""The executor on hand-written schedules, ranks as threads over the loopback transport,
against the unpipelined model: the same loss on every rank and the same gradients."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import pytest
import torch
from pipeline_cases import gradients
from torch import nn

from pipetrain.distributed.loopback import LoopbackGroup, LoopbackTransport
from pipetrain.distributed.transport import PeerError
from pipetrain.model.frontend import front_end
from pipetrain.runtime.assembly import assemble
from pipetrain.runtime.config import PipelineConfig, RuntimeConfig
from pipetrain.runtime.rank.batch import StepData
from pipetrain.runtime.rank.cycle import UpdateCycle
from pipetrain.runtime.rank.executor import ActionFailed
from pipetrain.runtime.rank.update_config import UpdateConfig
from pipetrain.schedules import Action, Schedule, forward_only, with_targets_shipped
from pipetrain.timeline import Event

BATCH, LR = 12, 0.5


def model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Linear(6, 3))


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, 4, generator=generator), torch.randint(
        0, 3, (BATCH,), generator=generator
    )


@dataclass
class RankResult:
    loss: float | None
    grads: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor]
    outputs: dict[int, tuple[torch.Tensor, ...]]
    events: list[Event]
    cycle: UpdateCycle


def play(
    schedule: Schedule,
    balance: list[int],
    *,
    recompute: str = "never",
    ship_targets: bool = False,
    targets: bool = True,
    per_update: int | None = None,
    optimizer: bool = False,
    data: tuple[torch.Tensor, torch.Tensor] | None = None,
    broken_stage: int | None = None,
    group: LoopbackGroup | None = None,
    update: UpdateConfig | None = None,
    counted: dict[int, list[int]] | None = None,
    loss_fn: Callable[..., Any] = nn.functional.cross_entropy,
) -> list[RankResult]:
    """Run ``schedule`` once with every rank a thread, each holding its own copy of the model,
    built by the library's own assembly on the loopback transport; ``counted[rank]``, if
    given, records the size of every all-reduce a rank makes."""
    x, y = data if data is not None else batch()
    last = schedule.stages - 1
    base = model()  # seeded here: the threads share the random generator

    def rank(transport: LoopbackTransport) -> RankResult:
        if counted is not None:
            plain = transport.all_reduce

            def all_reduce(tensor: torch.Tensor) -> None:
                counted[transport.rank].append(tensor.numel())
                plain(tensor)

            transport.all_reduce = all_reduce  # type: ignore[method-assign]
        parts = assemble(
            schedule,
            transport.rank,
            front_end(copy.deepcopy(base)),
            balance,
            loss_fn,
            partial(torch.optim.SGD, lr=LR) if optimizer else None,
            config=PipelineConfig(recompute=recompute),
            update=update,
            runtime=RuntimeConfig(record=True),
            per_update=per_update,
            transport=transport,
        )
        modules = parts.stages
        if broken_stage in modules:
            modules[broken_stage].register_forward_hook(_explode)
        step_data = StepData(schedule.microbatches, per_update or schedule.microbatches, x.device)
        if 0 in modules:
            step_data.set_inputs(x)
            if ship_targets:
                step_data.set_shipped(y)
        if last in modules and targets and not ship_targets:
            step_data.set_targets(y)
        parts.cycle.start_call(update=True)
        outcome = parts.executor.run(schedule, step_data)
        transport.flush()
        named = [(n, p) for m in modules.values() for n, p in m.named_parameters()]
        return RankResult(
            None if outcome.loss is None else float(outcome.loss),
            gradients(named),
            {n: p.detach().clone() for n, p in named},
            outcome.outputs,
            parts.recorder.events,
            parts.cycle,
        )

    return (group or LoopbackGroup(schedule.num_ranks, timeout_s=10)).run(rank)


def _explode(module: nn.Module, inputs: object, output: object) -> None:
    raise ValueError("bad stage on purpose")


def reference(data: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[float, dict]:
    whole = model()
    x, y = data if data is not None else batch()
    loss = nn.functional.cross_entropy(whole(x), y)
    loss.backward()
    return loss.item(), gradients(whole.named_parameters())


def assert_matches_reference(results: list[RankResult]) -> None:
    expected_loss, expected = reference()
    losses = [r.loss for r in results]
    assert losses == [losses[0]] * len(results), "ranks disagree on the loss"
    assert losses[0] == pytest.approx(expected_loss, rel=1e-6)
    # replicas of a stage each hold the gradients of their own micro-batches: they add up
    got: dict[str, torch.Tensor] = {}
    for result in results:
        for name, grad in result.grads.items():
            got[name] = got[name] + grad if name in got else grad
    assert sorted(got) == sorted(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=name)


FILL_AND_DRAIN_LIFO = """
# every forward, then the backwards in reverse order on rank 0
rank 0: F0.0 F0.1 F0.2 B0.2 B0.1 B0.0 STEP0
rank 1: F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 STEP1
"""

SPLIT_BACKWARD = """
rank 0: F0.0 F0.1 B0.0 F0.2 B0.1 W0.0 B0.2 W0.2 W0.1 STEP0
rank 1: F1.0 B1.0 F1.1 W1.0 B1.1 F1.2 B1.2 W1.2 W1.1 STEP1
"""

# four stages in a V: rank 0 holds the first and the last, rank 1 the two in the middle
V_SHAPE = """
placement: 0 1 1 0
rank 0: F0.0 F0.1 F3.0 B3.0 F3.1 B3.1 B0.0 B0.1 STEP0 STEP3
rank 1: F1.0 F2.0 F1.1 F2.1 B2.0 B1.0 B2.1 B1.1 STEP1 STEP2
"""

# the last stage on two replicas, micro-batches round-robin
REPLICATED_LAST = """
placement: 0 1,2
rank 0: F0.0 F0.1 F0.2 F0.3 B0.0 B0.1 B0.2 B0.3 STEP0
rank 1: F1.0 B1.0 F1.2 B1.2 STEP1
rank 2: F1.1 B1.1 F1.3 B1.3 STEP1
"""

CASES = {
    "fill-and-drain-lifo": (FILL_AND_DRAIN_LIFO, [2, 2]),
    "split-backward": (SPLIT_BACKWARD, [3, 1]),
    "v-shape": (V_SHAPE, [1, 1, 1, 1]),
    "replicated-last": (REPLICATED_LAST, [1, 3]),
}


@pytest.mark.parametrize("recompute", ["never", "except_last", "always"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_written_schedules_match_the_unpipelined_model(case: str, recompute: str) -> None:
    text, balance = CASES[case]
    assert_matches_reference(play(Schedule.from_text(text), balance, recompute=recompute))


ONE_UPDATE = """
rank 0: F0.0 F0.1 B0.0 B0.1 STEP0
rank 1: F1.0 B1.0 F1.1 B1.1 STEP1
"""


def test_an_update_sums_the_loss_so_the_step_needs_no_loss_all_reduce() -> None:
    schedule = Schedule.from_text(ONE_UPDATE)
    reduced: dict[int, list[int]] = {0: [], 1: []}
    counted = play(schedule, [2, 3], optimizer=True, counted=reduced)
    expected_loss, _ = reference()
    assert [r.loss for r in counted] == pytest.approx([expected_loss] * 2, rel=1e-6)
    assert reduced == {0: [5], 1: [5]}  # norm, overflow, then loss, count, pairs


def test_a_pair_loss_is_divided_by_its_count_within_the_updates_all_reduce() -> None:
    schedule = Schedule.from_text(ONE_UPDATE)
    reduced: dict[int, list[int]] = {0: [], 1: []}

    def summed(outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return nn.functional.cross_entropy(outputs, targets, reduction="sum"), torch.tensor(
            targets.numel()
        )

    pairs = play(schedule, [2, 3], optimizer=True, counted=reduced, loss_fn=summed)
    means = play(schedule, [2, 3], optimizer=True)
    # the update's one all-reduce carries the count: norm, overflow, loss, count, pairs
    assert reduced == {0: [5], 1: [5]}
    expected_loss, _ = reference()
    assert [r.loss for r in pairs] == pytest.approx([expected_loss] * 2, rel=1e-6)
    for pair, mean in zip(pairs, means):  # the same update as the batch mean's
        for name, weight in pair.weights.items():
            torch.testing.assert_close(weight, mean.weights[name], rtol=1e-6, atol=1e-7)


def test_a_rank_holding_the_input_and_last_stage_reads_its_own_targets() -> None:
    lanes = tuple(
        tuple(Action.parse(text) for text in lane)
        for lane in (("F0.0", "B0.0", "STEP0"), ("F0.1", "B0.1", "STEP0"))
    )
    assert with_targets_shipped(lanes, [[0, 1]]) == lanes  # one stage on two replicas
    two_stages = with_targets_shipped(lanes, [[0], [1]])
    assert [str(two_stages[0][0]), str(two_stages[1][0])] == ["SEND_T0@1", "RECV_T1@0"]


def test_targets_shipped_by_the_schedule_reach_the_last_stage() -> None:
    schedule = Schedule.from_text(
        """
        placement: 0 1 1
        rank 0: F0.0 F0.1 B0.0 B0.1 STEP0
        rank 1: F1.0 F2.0 B2.0 B1.0 F1.1 F2.1 B2.1 B1.1 STEP1 STEP2
        """
    )
    shipped = replace(schedule, ranks=with_targets_shipped(schedule.ranks, schedule.stage_ranks))
    assert [str(a) for a in shipped.ranks[0][:1]] == ["SEND_T0@1"]
    assert [str(a) for a in shipped.ranks[1][:1]] == ["RECV_T2@0"]
    results = play(shipped, [1, 2, 1], ship_targets=True)
    assert_matches_reference(results)
    assert {"SEND_T", "LOSS"} <= {e.kind for e in results[0].events}
    assert "RECV_T" in {e.kind for e in results[1].events}


def test_evaluation_gathers_every_output_on_the_first_last_stage_rank() -> None:
    training = Schedule.from_text(REPLICATED_LAST)
    lanes = forward_only(training.ranks, training.stage_ranks)
    evaluation = replace(training, ranks=lanes)
    x, _ = batch()
    with torch.no_grad():
        results = play(evaluation, [1, 3], targets=False)
    assert results[0].outputs == {} and results[2].outputs == {}
    assert sorted(results[1].outputs) == [0, 1, 2, 3]
    gathered = torch.cat([results[1].outputs[k][0] for k in range(4)])
    torch.testing.assert_close(gathered, model()(x))
    assert all(r.loss is None for r in results)
    assert "RECV_O" in {e.kind for e in results[1].events}
    assert "SEND_O" in {e.kind for e in results[2].events}


def test_the_loss_is_all_reduced_by_the_closing_loss_action() -> None:
    results = play(Schedule.from_text(FILL_AND_DRAIN_LIFO), [2, 2])
    for result in results:
        assert result.events[-1].kind == "LOSS"
    # rank 0 computes no loss itself, yet returns the step's
    assert results[0].loss == results[1].loss == pytest.approx(reference()[0], rel=1e-6)


def test_an_asynchronous_schedule_updates_on_the_versions_it_names() -> None:
    # pipedream on two ranks: mini-batch k runs stage 0 on version max(0, k - 1), stage 1 on k
    text = """
    rank 0: F0.0v0 F0.1v0 B0.0v0 STEP0v1 F0.2v1 B0.1v0 STEP0v2 F0.3v2 B0.2v1 STEP0v3 B0.3v2 STEP0v4
    rank 1: F1.0v0 B1.0v0 STEP1v1 F1.1v1 B1.1v1 STEP1v2 F1.2v2 B1.2v2 STEP1v3 F1.3v3 B1.3v3 STEP1v4
    """
    schedule = Schedule.from_text(text)
    assert schedule.asynchronous
    data = batch(seed=3)
    results = play(schedule, [2, 2], per_update=1, optimizer=True, data=data)
    whole = model()
    stage_of = {n: 0 if int(n.split(".")[0]) < 2 else 1 for n, _ in whole.named_parameters()}
    versions = [{n: p.detach().clone() for n, p in whole.named_parameters()}]
    for k, (x, y) in enumerate(zip(*(torch.tensor_split(t, 4) for t in data))):
        used = {0: max(0, k - 1), 1: k}
        current = {n: versions[used[stage_of[n]]][n].clone().requires_grad_(True) for n in stage_of}
        loss = nn.functional.cross_entropy(torch.func.functional_call(whole, current, (x,)), y)
        grads = dict(zip(current, torch.autograd.grad(loss, list(current.values()))))
        versions.append({n: versions[-1][n] - LR * grads[n] for n in stage_of})
    got = {**results[0].weights, **results[1].weights}
    for name, value in versions[-1].items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_failing_action_names_rank_stage_and_action_and_stops_the_others() -> None:
    group = LoopbackGroup(2, timeout_s=10)
    with pytest.raises(ActionFailed, match=r"rank 1 \(stage 1\) failed at F1.0: ValueError: bad"):
        play(Schedule.from_text(FILL_AND_DRAIN_LIFO), [2, 2], broken_stage=1, group=group)
    # rank 0, waiting for a gradient from rank 1, gave up at once naming it
    waiting = group.errors()[0]
    assert isinstance(waiting, PeerError) and waiting.peer == 1
