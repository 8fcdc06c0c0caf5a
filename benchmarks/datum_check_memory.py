"""Peak memory and time of forward_backward's up-front datum check on a call of very uneven
lengths: the whole call padded into one batch (how the check ran before) against one
micro-batch at a time over the worker's own plan (how it runs now).

The call is one long datum and many short ones with ppo inputs (target tokens, behaviour
logprobs, advantages): 16384 + 2000 x 64 tokens by default. Padding them together makes a
[2001, 16384] batch, 250x the real tokens. Each mode runs in a fresh process; the figures are
the rise of the process's peak RSS (ru_maxrss) over its level just before the check, and the
check's wall time (noisy on a shared machine; the memory is not).

    python benchmarks/datum_check_memory.py [--long 16384] [--short 2000] [--short-length 64]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
from host import host_line

from posttrain.algo.losses import LossConfig
from posttrain.engine import datum_checks
from posttrain.engine.shared_prefix import plan_micro_batches
from posttrain.engine.worker import WorkerConfig
from posttrain.types import Datum, ModelInput

VOCAB = 32000


def make_datums(long: int, short: int, short_length: int) -> list[Datum]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for length in [long] + [short_length] * short:
        ids = torch.randint(0, VOCAB, (length + 1,), generator=gen)
        inputs = {
            "target_tokens": ids[1:],
            "logprobs": -torch.rand(length, generator=gen),
            "advantages": torch.randn(length, generator=gen),
        }
        out.append(Datum(ModelInput.from_ints(ids[:-1].tolist()), inputs))
    return out


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def measure(mode: str, long: int, short: int, short_length: int) -> dict[str, float]:
    """One check of `mode` ("whole" or "micro") in this process."""
    datums = make_datums(long, short, short_length)
    config = WorkerConfig()  # the worker's defaults: budget and prefix sharing
    plan = plan_micro_batches(
        [d.model_input.to_ints() for d in datums],
        config.micro_batch_tokens,
        config.min_shared_prefix,
    )
    batches = [list(range(len(datums)))] if mode == "whole" else [m.rows for m in plan]
    before = peak_rss_mb()
    start = time.perf_counter()
    datum_checks.check_datums(
        datums,
        "ppo",
        LossConfig(),
        vocab_size=VOCAB,
        max_positions=long,
        micro_batches=batches,
    )
    seconds = time.perf_counter() - start
    return {"peak_rss_rise_mb": peak_rss_mb() - before, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description="Peak memory of the up-front datum check")
    parser.add_argument("--long", type=int, default=16384)
    parser.add_argument("--short", type=int, default=2000)
    parser.add_argument("--short-length", type=int, default=64)
    parser.add_argument("--mode", choices=["whole", "micro"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = (args.long, args.short, args.short_length)
    if args.mode is not None:  # the child process: measure one mode, print JSON
        print(json.dumps(measure(args.mode, *sizes)))
        return
    print(host_line(), flush=True)
    for mode in ("whole", "micro"):
        command = [sys.executable, __file__, "--mode", mode]
        command += ["--long", str(args.long), "--short", str(args.short)]
        command += ["--short-length", str(args.short_length)]
        result = json.loads(subprocess.run(command, check=True, capture_output=True).stdout)
        print(
            f"{mode:>5}: peak RSS +{result['peak_rss_rise_mb']:.0f} MB, {result['seconds']:.2f} s"
        )


if __name__ == "__main__":
    main()
