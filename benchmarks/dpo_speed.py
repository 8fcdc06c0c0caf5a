"""DPO throughput: preference pairs per second of `LocalBackend.train_dpo` on a tiny model.

Each call scores every pair with the reference (base model: LoRA off) once, then makes one
update per `--batch-size` pairs through `forward_backward_custom` (a forward pass for the
logprobs, the loss on them, then a forward and backward pass with their gradient as weights):
three forward passes and one backward per completion, ~5 forward-equivalents.

Measured (2-core shared CPU, 2 torch threads, 32 pairs of 64+64 tokens, batch_size 8):
'tiny' 115 pairs/s (load average 0.9); 'small' 2.6 pairs/s (load average 1.6; 0.9 at 2.8). The first call is a
warm-up; the median of the others is reported, with torch's thread count and the load average
(other processes on a shared machine slow every call alike).

    python benchmarks/dpo_speed.py [--size small] [--pairs 32] [--batch-size 8]
        [--prompt 64] [--completion 64] [--repeats 3] [--threads 2] [--loss sigmoid]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

import torch
from host import host_line

import posttrain
from posttrain.backends.local import LocalBackend
from posttrain.data.preferences import PreferencePair
from posttrain.models.tiny import make_tiny_model


def make_pairs(count: int, prompt: int, completion: int) -> list[PreferencePair]:
    gen = torch.Generator().manual_seed(0)

    def tokens(length: int) -> tuple[int, ...]:
        return tuple(torch.randint(3, 250, (length,), generator=gen).tolist())

    return [
        PreferencePair(tokens(prompt), tokens(completion), tokens(completion)) for _ in range(count)
    ]


async def measure(args: argparse.Namespace, base: str, path: str) -> list[float]:
    backend = LocalBackend(path)
    model = posttrain.TrainableModel(name="dpo", project="bench", base_model=base, lora_rank=8)
    await model.register(backend)
    pairs = make_pairs(args.pairs, args.prompt, args.completion)
    seconds = []
    for _ in range(args.repeats + 1):
        began = time.perf_counter()
        await backend.train_dpo(
            model, pairs, batch_size=args.batch_size, loss=args.loss, save_checkpoint=False
        )
        seconds.append(time.perf_counter() - began)
    await backend.close()
    return seconds[1:]  # the first call warms up


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "mini", "small"])
    parser.add_argument("--pairs", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--completion", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--loss", default="sigmoid", choices=["sigmoid", "ipo"])
    args = parser.parse_args()
    print(host_line(), flush=True)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        base = str(make_tiny_model(f"{tmp}/model", size=args.size))
        seconds = asyncio.run(measure(args, base, f"{tmp}/runs"))
    median = statistics.median(seconds)
    tokens = args.pairs * (args.prompt + args.completion) * 2
    print(
        f"DPO ({args.loss}) on tiny '{args.size}' (LoRA 8): {args.pairs} pairs of "
        f"{args.prompt}+{args.completion} tokens, batch_size {args.batch_size}"
    )
    print(
        f"  median {median:.2f}s per call over {len(seconds)} calls: "
        f"{args.pairs / median:.1f} pairs/s, {tokens / median:.0f} sequence tokens/s"
    )
    print(f"  torch threads {torch.get_num_threads()}, load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
