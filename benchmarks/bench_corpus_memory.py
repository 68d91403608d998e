"""Memory of streaming a large JSONL corpus: peak RSS after the first batches and after
the whole corpus (a scan, then every training batch of one epoch).

    python benchmarks/bench_corpus_memory.py --megabytes 1024

The corpus is generated into a temporary directory (documents of 8 to 4,096 bytes, most
short) and removed afterwards. Bytes tokenizer; a constant-memory reader's peak does not
grow between the two readings.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import tempfile
import time
from pathlib import Path

from pipetrain.data import Corpus


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def generate(path: Path, megabytes: int, seed: int = 0) -> int:
    chance = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz      \n"
    block = "".join(chance.choice(alphabet) for _ in range(1 << 16))
    written = lines = 0
    with open(path, "w") as out:
        while written < megabytes << 20:
            length = min(4096, max(8, int(chance.paretovariate(1.2) * 64)))
            start = chance.randrange(len(block) - length)
            line = json.dumps({"text": block[start : start + length]}) + "\n"
            out.write(line)
            written, lines = written + len(line), lines + 1
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--megabytes", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "corpus.jsonl"
        lines = generate(path, args.megabytes)
        size = path.stat().st_size / (1 << 20)
        print(f"corpus: {size:.0f} MiB, {lines} documents; peak RSS {peak_rss_mib():.0f} MiB")
        corpus = Corpus(path, seq_len_max=1024)
        batches = corpus.batches(args.batch_size)
        for _ in range(10):
            next(batches)
        early = peak_rss_mib()
        print(f"after 10 batches: peak RSS {early:.0f} MiB")
        started = time.perf_counter()
        summary = corpus.scan()
        print(f"scan: {summary}; {time.perf_counter() - started:.0f} s")
        count = 0
        while batches.epoch == 0:
            next(batches)
            count += 1
        print(
            f"after the scan and {count + 10} batches (one epoch): peak RSS "
            f"{peak_rss_mib():.0f} MiB (after 10 batches: {early:.0f} MiB)"
        )


if __name__ == "__main__":
    main()
