"""RoundPipe in the planner: its workers' working set, its host store, its host link in the
prediction, when it is chosen and why the others lose, and the hand-given schedule's check."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from pipetrain.app import cli
from pipetrain.app.worker_memory import check_worker_memory, even_balance, host_schedule_peak
from pipetrain.planning import Plan, Topology, plan
from pipetrain.planning.candidates import Candidate
from pipetrain.planning.host_store import balanced_peaks, host_store_bytes, rank_stages
from pipetrain.planning.layouts import Layout
from pipetrain.profiler import LayerCost, Profile
from pipetrain.runtime.config import PipelineConfig
from pipetrain.schedules import build, names, spec
from pipetrain.simulation import Costs, simulate
from pipetrain.units import format_bytes, parse_bytes


def hand_profile() -> Profile:
    """Six layers: layer i has 100·(i+1) bytes of weights, twice that of optimizer state,
    a 10·(i+1)-byte output (kept for its backward) and a 5-byte model input."""
    return Profile(
        [
            LayerCost(
                forward_s=1.0,
                backward_s=2.0,
                activation_bytes=10.0 * (i + 1),
                parameter_bytes=100.0 * (i + 1),
                optimizer_bytes=200.0 * (i + 1),
            )
            for i in range(6)
        ],
        input_bytes=5.0,
    )


# the memory model against a count by hand ----------------------------------------------
# balance [1, 2, 1, 2] dealt over 2 ranks, 3 micro-batches: rank 0 runs stages 0 (layer 0)
# and 2 (layer 3), rank 1 stages 1 (layers 1-2) and 3 (layers 4-5).
# rank 0: weights 100 and 400; activations (input + outputs) 5+10 and 30+40; the largest
#   layer output 40; sends its outputs 10 and 40 each micro-batch
# rank 1: weights 200+300 and 500+600; activations 10+20+30 and 40+50+60; largest 60;
#   sends 30 (stage 3 is the last: it sends nothing)
RANK_0 = {"resident": 2 * (100 + 400), "one": 2 * 400, "acts": 3 * (15 + 70), "rest": 40 + 3 * 50}
RANK_1 = {"resident": 2 * (500 + 1100), "one": 2 * 1100, "acts": 3 * (60 + 150), "rest": 60 + 90}


def test_a_workers_peak_is_counted_as_by_hand() -> None:
    profile = hand_profile()
    by_hand = [r["resident"] + r["acts"] + r["rest"] for r in (RANK_0, RANK_1)]
    assert balanced_peaks(profile, [1, 2, 1, 2], 2, 3, resident=2) == pytest.approx(by_hand)
    one_at_a_time = [r["one"] + r["acts"] + r["rest"] for r in (RANK_0, RANK_1)]
    assert balanced_peaks(profile, [1, 2, 1, 2], 2, 3, resident=1) == pytest.approx(one_at_a_time)
    # recomputation keeps stage inputs (5 and 30; 10 and 40) and re-materialises the largest
    inputs = [3 * (5 + 30) + 70, 3 * (10 + 40) + 150]
    recomputed = [r["resident"] + kept + r["rest"] for r, kept in zip((RANK_0, RANK_1), inputs)]
    got = balanced_peaks(profile, [1, 2, 1, 2], 2, 3, resident=2, recompute="always")
    assert got == pytest.approx(recomputed)
    # except_last: each stage's last micro-batch is kept whole until after the turn
    whole_last = [(15 - 5) + (70 - 30), (60 - 10) + (150 - 40)]
    keeping = [peak + extra for peak, extra in zip(recomputed, whole_last)]
    got = balanced_peaks(profile, [1, 2, 1, 2], 2, 3, resident=2, recompute="except_last")
    assert got == pytest.approx(keeping)


def test_the_host_store_holds_the_model_once() -> None:
    # weights 2100, their gradients 2100, optimizer state 4200
    assert host_store_bytes(hand_profile()) == 8400


@pytest.mark.parametrize(("ranks", "stages"), [(2, 2), (2, 4), (2, 5), (3, 3), (3, 7), (3, 9)])
@pytest.mark.parametrize("microbatches", [1, 3, 4])
def test_the_simulated_timeline_holds_every_microbatch_of_every_stage_at_the_turn(
    ranks: int, stages: int, microbatches: int
) -> None:
    """The model counts all of a rank's stages' micro-batches held at once; the simulated
    timeline's peak of (stage, micro-batch) pairs held says the same."""
    schedule = build("roundpipe", ranks, microbatches, model_stages=stages)
    costs = Costs(forward_s=1.0, backward_s=2.0, load_s=0.5, offload_s=0.5)
    peaks = simulate(schedule, costs).peak_activations
    assert peaks == [microbatches * len(rank_stages(stages, ranks, r)) for r in range(ranks)]


# the planner -----------------------------------------------------------------------------
def heavy_weights_profile(layers: int = 16) -> Profile:
    """Weights and Adam state far larger than the activations: 40 MB of weights a layer."""
    return Profile(
        [
            LayerCost(
                forward_s=1e-3,
                backward_s=2e-3,
                activation_bytes=1e5,
                parameter_bytes=4e7,
                optimizer_bytes=8e7,
                optimizer_s=1e-3,
            )
            for _ in range(layers)
        ],
        input_bytes=1e5,
    )


def test_a_model_that_fits_only_under_roundpipe_is_planned_as_roundpipe() -> None:
    profile, limit = heavy_weights_profile(), 300e6
    chosen = plan(profile, workers=4, memory_limit=limit)
    assert chosen.schedule == "roundpipe" and chosen.host_stored
    assert max(chosen.stage_memory_bytes) <= limit
    assert chosen.host_bytes == pytest.approx(16 * (2 * 4e7 + 8e7))
    # its stages are dealt round-robin, each rank's peak its working set
    peaks = balanced_peaks(profile, chosen.balance, 4, chosen.microbatches, resident=2)
    dealt = [peaks[s % 4] for s in range(len(chosen.stages))]
    assert chosen.stage_memory_bytes == pytest.approx(dealt)
    assert len(chosen.stages) == chosen.virtual * chosen.ranks
    build("roundpipe", chosen.ranks, chosen.microbatches, model_stages=len(chosen.stages))
    # every other family is refused for memory, naming its smallest peak and the limit
    others = [name for name in names() if spec(name).planned_by_default and name != "roundpipe"]
    assert set(chosen.rejected) == set(others)
    for name in others:
        reason = chosen.rejected[name]
        found = re.search(
            r"over the memory limit of (.+?): needs at least (.+?) on a worker", reason
        )
        assert found, reason
        assert found[1] == format_bytes(limit) and parse_bytes(found[2].replace(" ", "")) > limit
    assert "host store: 2.56 GB" in chosen.describe()


def test_a_model_that_fits_anywhere_is_not_forced_into_roundpipe() -> None:
    profile = heavy_weights_profile()
    # a slow host link: every stage's load and return costs far more than its compute
    chosen = plan(profile, workers=4, host_bandwidth=1e8)
    assert chosen.schedule != "roundpipe" and chosen.host_bytes == 0
    assert re.search(r"slower|cannot be faster", chosen.rejected["roundpipe"])
    # the same when only memory is short for nothing
    roomy = plan(profile, workers=4, memory_limit=100e9, host_bandwidth=1e8)
    assert roomy.schedule == chosen.schedule


def test_the_host_link_is_in_the_prediction() -> None:
    profile = heavy_weights_profile()
    fast = plan(profile, workers=2, schedules=["roundpipe"], microbatches=[4])
    slow = plan(profile, workers=2, schedules=["roundpipe"], microbatches=[4], host_bandwidth=1e9)
    # each rank loads half the model's 640 MB at least once at 1 GB/s: 0.32 s at the least
    assert slow.steady_step_s is not None and fast.steady_step_s is not None
    assert slow.steady_step_s >= 0.32 > fast.steady_step_s


def test_each_stages_optimizer_step_is_its_workers_compute_and_its_bytes_cross_the_link() -> None:
    profile = heavy_weights_profile(layers=8)
    dealt = Layout(tuple((2 * s, 2 * s + 2, 1) for s in range(4)), 2, host_link=1e9)
    costs = Candidate(dealt, "roundpipe", 4, "never", profile).costs(Topology.flat(2))
    # two layers a stage: 80 MB of weights each way at 1 GB/s; the input-gradient halves of
    # two 2 ms backwards, 2 ms, and the stage's 2 ms step shared over 4 micro-batches
    assert costs.load_s == pytest.approx([0.08] * 4) and costs.offload_s == costs.load_s
    assert costs.backward_s == pytest.approx([2e-3 + 2e-3 / 4] * 4)
    assert costs.weight_s == pytest.approx([2e-3] * 4)


def test_a_host_store_over_the_host_limit_rules_roundpipe_out() -> None:
    profile = heavy_weights_profile()
    chosen = plan(profile, workers=4, host_memory_limit=1e9)
    assert chosen.schedule != "roundpipe"
    assert (
        "host store holds the whole model, 2.56 GB, over the host memory limit of 1 GB"
        in (chosen.rejected["roundpipe"])
    )
    with pytest.raises(ValueError, match=r"host store of 2\.56 GB, over the host memory limit"):
        plan(profile, workers=4, schedules=["roundpipe"], host_memory_limit=1e9)
    with pytest.raises(ValueError, match="host_bandwidth must be a positive"):
        plan(profile, workers=4, host_bandwidth=0)


def random_profile(rng: np.random.Generator) -> Profile:
    """A few layers of random compute, weights, activations and optimizer steps."""
    layers = int(rng.integers(4, 13))
    return Profile(
        [
            LayerCost(
                forward_s=float(c),
                backward_s=float(2 * c),
                activation_bytes=float(a),
                parameter_bytes=float(w),
                optimizer_bytes=float(2 * w),
                optimizer_s=float(o),
            )
            for c, a, w, o in zip(
                rng.uniform(1e-3, 1e-2, layers),
                rng.uniform(1e4, 1e7, layers),
                rng.uniform(1e5, 1e8, layers),
                rng.uniform(0, 5e-3, layers),
            )
        ],
        microbatch_size=4,
        input_bytes=1e5,
    )


def _steady_throughput(chosen: Plan) -> float:
    assert chosen.steady_step_s is not None
    return chosen.predicted_throughput * chosen.predicted_step_s / chosen.steady_step_s


@pytest.mark.parametrize("seed", range(8))
def test_roundpipe_among_the_families_never_makes_the_choice_slower(seed: int) -> None:
    rng = np.random.default_rng(seed)
    profile = random_profile(rng)
    workers = int(rng.integers(2, 5))
    everyone = [name for name in names() if spec(name).planned_by_default]
    without = [name for name in everyone if name != "roundpipe"]
    settings = {"workers": workers, "batch_size": 16, "microbatches": (2, 4, 8)}
    free = plan(profile, schedules=without, **settings)  # type: ignore[arg-type]
    limit = float(max(free.stage_memory_bytes) * rng.uniform(0.3, 1.0))
    for memory_limit in (None, limit):
        with_it = plan(profile, schedules=everyone, memory_limit=memory_limit, **settings)  # type: ignore[arg-type]
        try:
            alone = plan(profile, schedules=without, memory_limit=memory_limit, **settings)  # type: ignore[arg-type]
        except ValueError:
            continue  # only roundpipe fits: anything is faster than nothing
        assert _steady_throughput(with_it) >= _steady_throughput(alone) * (1 - 1e-9)


# the plan file ---------------------------------------------------------------------------
def test_a_roundpipe_plan_round_trips_and_older_plans_still_load(tmp_path: Path) -> None:
    chosen = plan(heavy_weights_profile(), workers=4, memory_limit=300e6)
    chosen.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == chosen
    older = {**chosen.to_dict(), "format_version": 5, "schedule": "1f1b"}
    del older["host_bytes"]
    (tmp_path / "old.json").write_text(json.dumps(older))
    assert Plan.load(tmp_path / "old.json").host_bytes == 0


# a schedule given by hand ----------------------------------------------------------------
def test_a_hand_given_roundpipe_is_checked_against_the_worker_limit() -> None:
    profile, options = hand_profile(), {"model_stages": 4}
    by_hand = RANK_1["resident"] + RANK_1["acts"] + RANK_1["rest"]  # 3980 bytes, rank 1
    peak = check_worker_memory(profile, "roundpipe", 2, 3, options, 4000, balance=[1, 2, 1, 2])
    assert peak == by_hand
    with pytest.raises(ValueError) as refused:
        check_worker_memory(profile, "roundpipe", 2, 3, options, 3000, balance=[1, 2, 1, 2])
    message = str(refused.value)
    assert "needs 3.98 kB on rank 1" in message and "--worker-memory 3 kB" in message
    # one stage at a time fits: 2200 + 630 + 150 bytes; 8 stages would need 8 layers
    assert "--resident 1 (2.98 kB)" in message and "--model-stages" not in message
    assert "--recompute always" in message and "smaller --batch-size" in message


def test_a_hand_given_roundpipe_is_split_evenly_by_default() -> None:
    profile = hand_profile()
    assert even_balance(6, 4) == [2, 2, 1, 1]
    peak, rank = host_schedule_peak(profile, "roundpipe", 2, 3, {"model_stages": 4})
    evenly = balanced_peaks(profile, [2, 2, 1, 1], 2, 3, resident=2)
    assert peak == max(evenly) and rank == evenly.index(peak)
    with pytest.raises(ValueError, match="keeps its weights on its workers"):
        host_schedule_peak(profile, "1f1b", 2, 3, {})
    with pytest.raises(ValueError, match="--balance gives 3 stages, roundpipe deals 4"):
        host_schedule_peak(profile, "roundpipe", 2, 3, {"model_stages": 4}, balance=[2, 2, 2])


# the command line ------------------------------------------------------------------------
def test_plan_takes_the_worker_limit_by_its_name_and_its_former_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    heavy_weights_profile().save(tmp_path / "profile.json")
    base = ["plan", "--profile", str(tmp_path / "profile.json"), "--ranks", "4", "--json"]
    for flag in ("--worker-memory", "--memory"):
        assert cli.main([*base, flag, "300MB"]) == 0
        assert json.loads(capsys.readouterr().out)["schedule"] == "roundpipe"
    # with roundpipe's host store over the host limit, nothing fits
    assert cli.main([*base, "--worker-memory", "300MB", "--host-memory", "1GB"]) == 2
    assert "no candidate plan fits a memory limit of 300 MB" in capsys.readouterr().err


def test_plan_takes_the_host_links_bandwidth(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    heavy_weights_profile().save(tmp_path / "profile.json")
    base = ["plan", "--profile", str(tmp_path / "profile.json"), "--ranks", "2", "--json"]
    base += ["--batch-size", "4"]
    steps = []
    for rate in ("10GB/s", "1GB/s"):
        assert cli.main([*base, "--schedules", "roundpipe", "--host-bandwidth", rate]) == 0
        steps.append(json.loads(capsys.readouterr().out)["steady_step_s"])
    # each rank loads its half of the model's 640 MB at least once: 0.32 s at 1 GB/s
    assert steps[0] < 0.32 <= steps[1]


def test_train_refuses_a_worker_limit_it_cannot_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["train", "--model", "mlp", "--worker-memory", "200MB"]) == 2
    assert "give --plan auto or --schedule roundpipe" in capsys.readouterr().err


def test_train_refuses_a_roundpipe_over_the_worker_limit_before_any_worker_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["train", "--model", "mlp", "--schedule", "roundpipe", "--steps", "1"]
    assert cli.main([*args, "--worker-memory", "10kB"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"roundpipe with 4 model stages on 2 ranks .* over --worker-memory 10 kB", err)
    assert "starting" not in err


def test_a_roundpipe_plan_configures_a_pipeline_of_its_stages() -> None:
    chosen = plan(heavy_weights_profile(), workers=4, memory_limit=300e6)
    assert chosen.schedule == "roundpipe" and len(chosen.stages) != 2 * chosen.ranks
    schedule = PipelineConfig.from_plan(chosen).build(4, layers=16)
    assert schedule.stages == len(chosen.stages)
    assert [ranks[0] for ranks in schedule.stage_ranks] == [
        s % 4 for s in range(len(chosen.stages))
    ]
