"""Packed vs unpacked SFT: tokens/s of `LocalBackend.train_sft(packing=...)` side by side.

Trajectories have lengths drawn log-uniformly between `--min-length` and `--spread` times it
(10x by default: 32 to 320 tokens, a third of each prompt, the rest trained). Unpacked, each
micro-batch pads every trajectory to its longest; packed (`engine.packing`), they lie end to
end in rows as wide as the longest, each attending only to itself. Both runs see the same
trajectories, batches and model, alternating packed / unpacked each round after one warm-up
call of each; the median seconds per call of each are reported, with tokens/s counted over
the trajectories' real tokens, and their ratio (and the ratio of the fastest calls). Ratios side by side hold up on a shared
machine better than either figure alone.

    OMP_NUM_THREADS=2 python benchmarks/packing.py [--model packaged:smollm2-135m-instruct]
        [--size tiny] [--trajectories 32] [--batch-size 8] [--min-length 32] [--spread 10]
        [--lora-rank 16] [--rounds 2] [--threads 2]

`--size tiny` uses a locally built tiny model instead of `--model` (the smoke test's choice).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import tempfile
import time

import torch
from host import host_line

import posttrain
from posttrain.backends.local import LocalBackend
from posttrain.data.trajectories import TokenSegment, Trajectory
from posttrain.models.tiny import make_tiny_model


def make_trajectories(count: int, shortest: int, spread: float, vocab: int) -> list[Trajectory]:
    """`count` trajectories of log-uniform lengths in [shortest, shortest x spread]."""
    gen = torch.Generator().manual_seed(0)
    low, high = math.log(shortest), math.log(shortest * spread)
    out = []
    for _ in range(count):
        length = round(math.exp(low + (high - low) * float(torch.rand(1, generator=gen))))
        tokens = tuple(torch.randint(3, vocab, (max(length, 2),), generator=gen).tolist())
        prompt = max(1, len(tokens) // 3)
        out.append(
            Trajectory((TokenSegment(tokens[:prompt]), TokenSegment(tokens[prompt:], True)), 0.0)
        )
    return out


async def measure(
    args: argparse.Namespace, base: str, path: str, trajectories: list[Trajectory]
) -> dict[bool, list[float]]:
    backend = LocalBackend(path)
    model = posttrain.TrainableModel(
        name="packing", project="bench", base_model=base, lora_rank=args.lora_rank
    )
    await model.register(backend)
    seconds: dict[bool, list[float]] = {True: [], False: []}
    for round_ in range(args.rounds + 1):
        for packing in (True, False) if round_ % 2 else (False, True):
            began = time.perf_counter()
            await backend.train_sft(
                model,
                trajectories,
                batch_size=args.batch_size,
                packing=packing,
                learning_rate=1e-5,
                save_checkpoint=False,
            )
            if round_ > 0:  # round 0 warms both up
                seconds[packing].append(time.perf_counter() - began)
    await backend.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="packaged:smollm2-135m-instruct")
    parser.add_argument("--size", choices=["tiny", "mini", "small"], default=None)
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--min-length", type=int, default=32)
    parser.add_argument("--spread", type=float, default=10.0)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(host_line(), flush=True)
    torch.set_num_threads(args.threads)
    trajectories = make_trajectories(args.trajectories, args.min_length, args.spread, vocab=250)
    lengths = [sum(len(s.tokens) for s in t.segments) for t in trajectories]
    tokens = sum(lengths)
    with tempfile.TemporaryDirectory() as tmp:
        base = args.model if args.size is None else str(make_tiny_model(f"{tmp}/m", size=args.size))
        seconds = asyncio.run(measure(args, base, f"{tmp}/runs", trajectories))
    packed, plain = statistics.median(seconds[True]), statistics.median(seconds[False])
    print(
        f"train_sft on {base if args.size is None else 'tiny ' + repr(args.size)} "
        f"(LoRA {args.lora_rank}): {len(lengths)} trajectories of {min(lengths)}-{max(lengths)} "
        f"tokens ({tokens} in all), batch_size {args.batch_size}"
    )
    for name, median in (("unpacked", plain), ("packed", packed)):
        print(f"  {name:8} median {median:.2f}s per call: {tokens / median:.0f} tokens/s")
    print(f"  packed / unpacked tokens/s: {plain / packed:.2f}x (medians)")
    for name, key in (("unpacked", False), ("packed", True)):
        print(f"  {name} calls (s): {', '.join(f'{t:.2f}' for t in seconds[key])}")
    # The fastest call of each: what a busy shared machine slows least.
    fastest = min(seconds[False]) / min(seconds[True])
    print(f"  packed / unpacked, fastest calls: {fastest:.2f}x")
    print(
        f"  torch threads {torch.get_num_threads()}, rounds {len(seconds[True])}, "
        f"load average {os.getloadavg()}"
    )


if __name__ == "__main__":
    main()
