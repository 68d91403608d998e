"""``pipetrain train``'s corpus flags (``--data`` and what reads it), without torch."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pipetrain.app.arguments import positive_int

if TYPE_CHECKING:
    from pipetrain.app.corpus_stream import CorpusSettings

SEQ_LEN_MAX = 256
EVAL_FRACTION = 0.05


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that train the built-in GPT on a user's corpus."""
    group = parser.add_argument_group("a corpus of your own (with --model gpt)")
    group.add_argument(
        "--data",
        metavar="PATH",
        help="train on this corpus instead of the built-in one: a text file (documents "
        "split at blank lines), a directory of documents, or JSONL with a text or input_ids "
        "field; read as a stream, so it may be larger than memory",
    )
    group.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="a local Hugging Face tokenizer directory (save_pretrained); default: bytes",
    )
    group.add_argument(
        "--seq-len-max",
        type=positive_int,
        default=SEQ_LEN_MAX,
        metavar="N",
        help=f"tokens a document keeps at most, the GPT's context (default {SEQ_LEN_MAX})",
    )
    group.add_argument(
        "--long-documents",
        choices=("truncate", "refuse"),
        default="truncate",
        help="a document over --seq-len-max: cut to its start (default) or refused, naming it",
    )
    group.add_argument(
        "--eval-fraction",
        type=_fraction,
        default=EVAL_FRACTION,
        metavar="F",
        help=f"documents held out for --eval-every (default {EVAL_FRACTION})",
    )
    group.add_argument(
        "--pack",
        action="store_true",
        help="pack each step's documents into rows of at most --seq-len-max tokens, several "
        "to a row (attention and positions stay within each document), split into "
        "--microbatches micro-batches",
    )
    group.add_argument(
        "--adaptive",
        action="store_true",
        help="each step, simulate how its documents could form micro-batches (consecutive, "
        "by length, within half, once or twice the token budget) on the GPT profiled at "
        "several lengths, and take the fastest (default budget: 4 x --seq-len-max)",
    )
    group.add_argument(
        "--microbatch-tokens",
        type=positive_int,
        metavar="K",
        help="form each step's micro-batches by a budget of K padded tokens (rows x their "
        "longest) instead of --microbatches, so their count follows the documents' lengths "
        "(synchronous schedules)",
    )


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def check_data_flags(args: argparse.Namespace) -> None:
    """Before torch loads: corpus flags given without ``--data``, ``--data`` with
    ``--ddp``, and ``--pack`` with ``--microbatch-tokens`` are refused naming the flags."""
    if args.data is None:
        given = [
            flag
            for flag, value, default in (
                ("--tokenizer", args.tokenizer, None),
                ("--seq-len-max", args.seq_len_max, SEQ_LEN_MAX),
                ("--long-documents", args.long_documents, "truncate"),
                ("--eval-fraction", args.eval_fraction, EVAL_FRACTION),
                ("--microbatch-tokens", args.microbatch_tokens, None),
                ("--pack", args.pack, False),
                ("--adaptive", args.adaptive, False),
            )
            if value != default
        ]
        if given:
            raise ValueError(f"{given[0]} reads a corpus of your own: give it with --data PATH")
        return
    if args.ddp:
        raise ValueError("--data trains a pipeline; leave out --ddp")
    if args.plan is not None and (args.microbatch_tokens is not None or args.adaptive):
        raise ValueError(
            "a plan fixes the micro-batch count and --microbatch-tokens (or --adaptive) "
            "changes it from step to step; give --plan or the token budget, not both"
        )
    if args.pack and args.microbatch_tokens is not None:
        raise ValueError(
            "--pack fills rows of --seq-len-max tokens and --microbatch-tokens groups documents "
            "of their own lengths; give one of them"
        )


def corpus_settings(args: argparse.Namespace) -> CorpusSettings | None:
    """The corpus ``--data`` names, read as the other flags say; ``None`` without it."""
    if args.data is None:
        return None
    from pipetrain.app.corpus_stream import CorpusSettings

    return CorpusSettings(
        args.data,
        args.tokenizer,
        args.seq_len_max,
        args.long_documents,
        args.eval_fraction,
        args.pack,
    )


def microbatch_tokens(args: argparse.Namespace) -> int | None:
    """The token budget: ``--microbatch-tokens``, or with ``--adaptive`` 4 x ``--seq-len-max``."""
    if args.microbatch_tokens is None and args.adaptive:
        return 4 * args.seq_len_max
    return args.microbatch_tokens
