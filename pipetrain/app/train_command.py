"""``pipetrain train``: its arguments, and the run's report printed as text or JSON."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from pipetrain.app.arguments import (
    add_model_argument,
    add_schedule_options,
    check_saving,
    emit,
    non_negative_float,
    output_path,
    positive_int,
    say,
    schedule_options,
)
from pipetrain.app.data_arguments import (
    add_data_arguments,
    check_data_flags,
    corpus_settings,
    microbatch_tokens,
)
from pipetrain.schedules import RECOMPUTE_MODES, names, spec
from pipetrain.units import parse_bytes

if TYPE_CHECKING:
    from pipetrain.app.train_config import TrainConfig
    from pipetrain.planning import Plan
    from pipetrain.runtime import PipelineConfig


def add_train(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "train",
        help="train a built-in model with a pipeline schedule and compare with the simulator",
        description=(
            "Train a built-in model on local worker processes (one per stage, gloo), or on the "
            "existing process group when started by torchrun. Prints loss, step time, "
            "throughput and the measured bubble beside the simulator's prediction."
        ),
    )
    add_model_argument(parser)
    parser.add_argument(
        "--ranks",
        type=positive_int,
        metavar="N",
        help="worker processes, one rank each (default: the sum of --replicas, else 2; under "
        "torchrun, the world size)",
    )
    # the former name of --ranks, refused with a message that names the new one
    parser.add_argument("--stages", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--schedule",
        choices=names(),
        metavar="NAME",
        help=f"one of {', '.join(names())} (default 1f1b); pipedream splits each batch into "
        "--microbatches mini-batches with an update each, 2bw makes --rounds updates per step; "
        "with --plan auto, the only schedule the planner may choose (default: any)",
    )
    parser.add_argument(
        "--microbatches",
        type=positive_int,
        default=4,
        metavar="M",
        help="micro-batches per step (default 4)",
    )
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=20,
        metavar="N",
        help="training steps, one batch each (default 20)",
    )
    parser.add_argument(
        "--accumulate",
        type=positive_int,
        default=1,
        metavar="N",
        help="steps whose gradients make one update (default 1; the last step always updates)",
    )
    parser.add_argument(
        "--max-grad-norm",
        type=_positive_float,
        metavar="X",
        help="clip the gradients to this global norm before every update (default: no clipping)",
    )
    parser.add_argument(
        "--lr-schedule",
        default="constant",
        choices=("constant", "warmup-cosine"),  # TrainConfig's LR_SCHEDULES, without torch
        metavar="NAME",
        help="constant (the default), or warmup-cosine: a linear warm-up over the first 10%% "
        "of the updates, then a cosine decay to 0",
    )
    parser.add_argument(
        "--precision",
        default="fp32",
        choices=("fp32", "bf16", "fp16"),  # the runtime's PRECISIONS, without torch
        metavar="NAME",
        help="fp32 (the default); bf16: forwards under bfloat16 autocast; fp16: float16 "
        "autocast with a loss scale that skips overflowing updates (synchronous schedules)",
    )
    parser.add_argument(
        "--eval-every",
        type=positive_int,
        metavar="N",
        help="every N steps, report the held-out loss (and the digit models' accuracy) on a "
        "fixed held-out batch",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        metavar="B",
        help="samples per step (default: 64, gpt 16)",
    )
    parser.add_argument(
        "--balance",
        type=_balance,
        metavar="N,N,...",
        help="layers per stage, e.g. 2,3 (default: even)",
    )
    parser.add_argument(
        "--recompute",
        default="never",
        choices=RECOMPUTE_MODES,
        metavar="MODE",
        help=f"re-materialization: {', '.join(RECOMPUTE_MODES)} (default never)",
    )
    parser.add_argument(
        "--lr", type=_positive_float, metavar="LR", help="Adam learning rate (default per model)"
    )
    add_schedule_options(parser)
    parser.add_argument(
        "--replicas",
        type=_balance,
        metavar="N,N,...",
        help="workers per stage, e.g. 2,1 ("
        + ", ".join(name for name in names() if spec(name).replicable)
        + "; default one each)",
    )
    parser.add_argument(
        "--data-parallel",
        type=positive_int,
        default=1,
        metavar="N",
        help="run every stage on N ranks, each taking every N-th micro-batch (gpipe, 1f1b and "
        "pipedream replicate stages; the other families run N copies of the pipeline; "
        "--ranks is then N times a pipeline's)",
    )
    parser.add_argument(
        "--shard",
        action="store_true",
        help="with --data-parallel: each of a stage's N ranks holds a shard of its "
        "parameters, gradients and optimizer state instead of a whole copy (synchronous "
        "schedules); with --plan auto: plan only layouts whose replicas hold shards",
    )
    parser.add_argument(
        "--tensor-parallel",
        type=positive_int,
        default=1,
        metavar="T",
        help="play every pipeline rank on T processes, each holding 1/T of every stage's "
        "linear layers as the model's tensor-parallel plan splits them (models given as "
        "layers with a plan, such as gpt; synchronous schedules; --ranks is then T times "
        "the pipeline's)",
    )
    parser.add_argument(
        "--plan",
        metavar="auto|PLAN.json",
        help="take split, replication, schedule and micro-batches from a plan; "
        "auto profiles and plans first",
    )
    parser.add_argument(
        "--worker-memory",
        dest="memory",
        type=_bytes,
        metavar="SIZE",
        help="memory per worker, e.g. 2GiB: with --plan auto, the plan must fit it "
        "(replicated stages may then be sharded, or roundpipe chosen); with --schedule "
        "roundpipe, its predicted worker peak is checked against it before the workers "
        "start (default: no limit)",
    )
    # its former name, still read
    parser.add_argument("--memory", dest="memory", type=_bytes, help=argparse.SUPPRESS)
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the weights and the data (default 0)"
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        metavar="N",
        help="torch threads per worker (default 1; under torchrun too)",
    )
    parser.add_argument(
        "--save-dir",
        metavar="DIR",
        help="save checkpoints here, and start from the newest complete one found here",
    )
    parser.add_argument(
        "--new-settings",
        action="store_true",
        help="resume from --save-dir with settings other than those saved (learning rate, "
        "batch size, seed, accumulation, clipping), which then apply; without it a "
        "difference is refused, naming each",
    )
    parser.add_argument(
        "--save-every",
        type=positive_int,
        metavar="N",
        help="save every N steps (default: only after the last step); needs --save-dir",
    )
    parser.add_argument(
        "--keep-checkpoints",
        type=positive_int,
        default=2,
        metavar="N",
        help="keep the N newest checkpoints (default 2)",
    )
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=300.0,
        metavar="S",
        help="seconds any receive or collective may wait before the run fails (default 300)",
    )
    parser.add_argument(
        "--trace",
        type=output_path,
        metavar="PATH",
        help="write the last step's timeline: .png (predicted and measured) or .json Chrome trace",
    )
    parser.add_argument(
        "--ddp",
        action="store_true",
        help="train data-parallel instead (DistributedDataParallel): a whole replica on each "
        "of --ranks workers, each on an equal share of every batch",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_data_arguments(parser)


def _check_worker_memory(args: argparse.Namespace, pipeline: PipelineConfig) -> None:
    """Refuse a hand-given host-stored schedule whose predicted worker peak exceeds
    ``--worker-memory``, before any worker starts (the model profiled here, once, on one
    micro-batch of its built-in data)."""
    from pipetrain.app.model_registry import model_spec
    from pipetrain.app.plan_job import profile_builtin
    from pipetrain.app.train_config import DEFAULT_RANKS
    from pipetrain.app.worker_memory import check_worker_memory

    batch = args.batch_size or model_spec(args.model).batch_size
    say(f"checking {args.schedule}'s worker memory against --worker-memory ...")
    profile = profile_builtin(args.model, batch, args.microbatches, args.seed, args.threads, 1)
    check_worker_memory(
        profile,
        args.schedule,
        args.ranks or DEFAULT_RANKS,
        args.microbatches,
        pipeline.schedule_options,
        args.memory,
        args.balance,
        args.recompute,
    )


def _balance(text: str) -> tuple[int, ...]:
    return tuple(positive_int(part) for part in text.split(","))


def _bytes(text: str) -> float:
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive_float(text: str) -> float:
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be greater than 0")
    return value


def run_train(args: argparse.Namespace) -> None:
    # before torch loads: a renamed flag and impossible save settings are answered at once
    refuse_stages(args)
    check_saving(args.save_dir, args.save_every, args.accumulate, args.keep_checkpoints)
    check_data_flags(args)
    hand_checked = args.memory is not None and args.plan != "auto"
    if hand_checked and not (args.schedule and spec(args.schedule).host_weights):
        raise ValueError(
            "--worker-memory is the limit --plan auto plans within, or that a schedule "
            "keeping its weights in a host store (--schedule roundpipe) is checked against: "
            "give --plan auto or --schedule roundpipe too"
        )
    from pipetrain.app.train_config import TrainConfig
    from pipetrain.app.train_job import run_training
    from pipetrain.app.train_resume import RunFinished
    from pipetrain.runtime import PipelineConfig, UpdateConfig

    pipeline = PipelineConfig(
        schedule=args.schedule or "1f1b",
        microbatches=args.microbatches,
        schedule_options=schedule_options(args),
        replicas=args.replicas,
        data_parallel=args.data_parallel,
        shard=args.shard,
        tensor_parallel=args.tensor_parallel,
        balance=args.balance,
        recompute=args.recompute,
        # only the input stage reads the built-in data; a corpus is read by the last stage too
        targets_on_first_stage=args.data is None,
        microbatch_tokens=microbatch_tokens(args),
    )
    update = UpdateConfig(max_grad_norm=args.max_grad_norm, precision=args.precision)
    plan_auto = args.plan == "auto"
    config = TrainConfig(
        args.model,
        pipeline,
        update,
        ranks=args.ranks,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        threads=args.threads,
        plan=_train_plan(args),
        plan_auto=plan_auto,
        plan_schedules=(args.schedule,) if args.schedule and plan_auto else None,
        plan_memory=args.memory,
        accumulate=args.accumulate,
        lr_schedule=args.lr_schedule,
        eval_every=args.eval_every,
        save_dir=args.save_dir,
        save_every=args.save_every,
        keep_checkpoints=args.keep_checkpoints,
        timeout_s=args.timeout,
        new_settings=args.new_settings,
        data=corpus_settings(args),
        adaptive=args.adaptive,
    )
    if hand_checked:
        _check_worker_memory(args, pipeline)
    if args.ddp:
        _run_ddp(args, config)
        return
    try:
        report = run_training(config)
    except RunFinished as finished:
        # exit 0, so that torchrun restarts no more; --json still gets its one object
        print(f"pipetrain train: {finished}", file=sys.stderr)
        if args.json:
            print(
                json.dumps(
                    {
                        "finished_before": True,
                        "checkpoint": finished.checkpoint,
                        "steps": finished.steps,
                    }
                )
            )
        return
    if report is None:  # a torchrun rank other than 0: rank 0 reports
        return
    if args.trace:
        report.write_trace(args.trace)
    emit(args, report.to_json(), report.summary(), ("timeline", args.trace) if args.trace else None)
    diverged = report.divergence()
    if diverged is not None:  # after the report, which keeps the losses
        raise RuntimeError(diverged)


def refuse_stages(args: argparse.Namespace) -> None:
    """Refuse ``--stages``, the former name of ``--ranks``: model stages and worker
    processes are different counts (a rank may hold several stages)."""
    if args.stages is not None:
        raise ValueError(
            f"--stages is now --ranks (worker processes): give --ranks {args.stages}; "
            "model stages follow from --balance or the schedule"
        )
    if args.tensor_parallel > 1 and args.plan is not None:
        raise ValueError(
            f"--plan lays out a pipeline without tensor parallelism; leave --plan out with "
            f"--tensor-parallel {args.tensor_parallel}"
        )


def _train_plan(args: argparse.Namespace) -> Plan | None:
    """The saved plan that ``--plan`` names; ``None`` without one or for ``auto``."""
    if args.plan in (None, "auto"):
        return None
    from pipetrain.planning import Plan

    return Plan.load(args.plan)


def _run_ddp(args: argparse.Namespace, config: TrainConfig) -> None:
    """``--ddp``: train ``config`` data-parallel and print its report."""
    from pipetrain.app.train_ddp import run_ddp_training

    if args.trace:
        raise ValueError("--trace draws a pipeline's last step, which --ddp has not; leave it out")
    if args.save_dir is not None:
        raise ValueError("--save-dir saves a pipeline's state, which --ddp has not; leave it out")
    report = run_ddp_training(config)
    if report is None:  # a torchrun rank other than 0: rank 0 reports
        return
    emit(args, report.to_json(), report.summary())
    diverged = report.divergence()
    if diverged is not None:  # after the report, which keeps the losses
        raise RuntimeError(diverged)
