"""TinkerBackend -> `posttrain serve` against LocalBackend: time of one RL train() step.

Both train a LoRA of the same rank on the `small` model (30M) with the same RL batch (groups of
sampled completions with sampler logprobs, PPO). Steps alternate between the two in one run
(the machine may be shared), each side's torch on the same number of threads (the server's
through OMP_NUM_THREADS); only one side computes at a time. Prints the median step time of
each, the ratio (goal <= 1.15), and the fixed cost of one call (a 1-token forward).

    python benchmarks/tinker_vs_local.py [--groups 8] [--group-size 8] [--completion-tokens 64]
        [--rounds 5] [--lora-rank 8] [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch
from host import host_line
from serve_process import KEY, serve

from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.backends.tinker import TinkerBackend
from posttrain.data.trajectories import TokenSegment, Trajectory, TrajectoryGroup
from posttrain.models.tiny import tiny_model_path
from posttrain.types import Datum, ModelInput


def rl_batch(args: argparse.Namespace, seed: int = 0) -> list[TrajectoryGroup]:
    """Groups sharing a prompt, completions of random byte tokens with logprobs near -5."""
    rng = random.Random(seed)
    groups = []
    for _ in range(args.groups):
        prompt = TokenSegment(tuple(rng.randrange(3, 250) for _ in range(args.prompt_tokens)))
        trajectories = []
        for _ in range(args.group_size):
            n = args.completion_tokens
            completion = TokenSegment(
                tuple(rng.randrange(3, 250) for _ in range(n)),
                trainable=True,
                logprobs=tuple(-5.5 + rng.random() for _ in range(n)),
            )
            reward = float(rng.random() > 0.5)
            trajectories.append(Trajectory((prompt, completion), reward=reward))
        groups.append(TrajectoryGroup(tuple(trajectories)))
    return groups


async def timed(job: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await job()
    return time.perf_counter() - start


async def run(args: argparse.Namespace, url: str, base_model: Path, root: Path) -> None:
    backends = {
        "local": LocalBackend(root / "local"),
        "tinker": TinkerBackend(root / "tinker", base_url=url, api_key=KEY),
    }
    models = {}
    for name, backend in backends.items():
        model = TrainableModel(
            name="bench", project="p", base_model=str(base_model), lora_rank=args.lora_rank
        )
        await model.register(backend)
        models[name] = model
    batch = rl_batch(args)
    one_token = [Datum(ModelInput.from_ints([5]), {"target_tokens": [6], "weights": [1.0]})]

    def step(name: str) -> Callable[[], Awaitable[object]]:
        backend, model = backends[name], models[name]
        return lambda: backend.train(model, batch, learning_rate=1e-5, save_checkpoint=False)

    def call(name: str) -> Callable[[], Awaitable[object]]:
        client = backends[name].client(models[name])
        return lambda: client.forward(one_token, "cross_entropy")

    for name in backends:  # warm-up: optimizer state, first requests, caches
        await step(name)()
        await call(name)()
    steps: dict[str, list[float]] = {name: [] for name in backends}
    calls: dict[str, list[float]] = {name: [] for name in backends}
    for _ in range(args.rounds):
        for name in backends:
            steps[name].append(await timed(step(name)))
            calls[name].append(await timed(call(name)))
    for backend in backends.values():
        await backend.close()

    tokens = args.groups * args.group_size * (args.prompt_tokens + args.completion_tokens)
    print(
        f"{args.size} model, LoRA rank {args.lora_rank}, fp32, {args.threads} torch threads per "
        f"side; RL batch {args.groups} groups x {args.group_size} x ({args.prompt_tokens} prompt "
        f"+ {args.completion_tokens} completion tokens) = {tokens} tokens, ppo; "
        f"{args.rounds} alternating rounds, medians"
    )
    local_s, tinker_s = (statistics.median(steps[n]) for n in ("local", "tinker"))
    print(f"train step: local {1000 * local_s:8.1f} ms | tinker->serve {1000 * tinker_s:8.1f} ms")
    print(f"ratio tinker/local: {tinker_s / local_s:.3f} (goal <= 1.15)")
    local_c, tinker_c = (statistics.median(calls[n]) for n in ("local", "tinker"))
    print(
        f"1-token forward (fixed cost of a call): local {1000 * local_c:.1f} ms | "
        f"tinker->serve {1000 * tinker_c:.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="TinkerBackend -> posttrain serve vs local.")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--completion-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--size", default="small", choices=["tiny", "mini", "small"], help="the tiny model's size"
    )
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    print(host_line(), flush=True)
    torch.set_num_threads(args.threads)
    base_model = tiny_model_path(size=args.size)
    with tempfile.TemporaryDirectory(prefix="posttrain-bench-") as tmp:
        root = Path(tmp)
        (root / "storage").mkdir()
        with serve(base_model, root / "storage", args.threads) as url:
            asyncio.run(run(args, url, base_model, root))


if __name__ == "__main__":
    main()
