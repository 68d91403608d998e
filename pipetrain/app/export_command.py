"""``pipetrain export``: a pipeline's checkpoint as one ``torch.save`` file."""

from __future__ import annotations

import argparse


def add_export(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "export",
        help="write a checkpoint as one torch.save file for the unpipelined model",
        description=(
            "Read a checkpoint saved by a pipeline (a step directory, or the newest complete "
            "one under a save directory) and write one torch.save file: a dict with 'model' "
            "(the full model's state_dict), 'optimizer' (state and hyperparameters by "
            "parameter name), 'lr_scheduler', 'precision', 'progress', 'extra' and 'layout'."
        ),
    )
    parser.add_argument("checkpoint", metavar="DIR", help="a step directory or a save directory")
    parser.add_argument("out", metavar="OUT.pt", help="the file to write")
    parser.add_argument(
        "--trust",
        action="store_true",
        help=(
            "load a checkpoint without a manifest (saved by an older pipetrain) or one holding "
            "objects that would run code to load: only for checkpoints from a trusted source"
        ),
    )


def run_export(args: argparse.Namespace) -> None:
    from pipetrain.checkpoint import export

    try:
        found = export(args.checkpoint, args.out, trust=args.trust)
    except FileNotFoundError as error:  # a bad argument, not a failed run
        raise ValueError(str(error)) from error
    print(f"wrote {args.out} from {found}")
