"""Step time of PPO with a learned critic (advantage_estimator="gae") against GRPO, on the same
batch: the ratio says what the critic costs.

Each step trains on the same groups (`--prompts` x `--group-size` completions of `--prompt` +
`--completion` tokens, sampler logprobs recorded), with loss "ppo", `--minibatches` mini-batches
and one epoch. A GAE step adds one critic forward (the values) and, per mini-batch, one critic
forward_backward and optimizer step: about twice GRPO's compute, since the critic is the
same-sized model. The two are measured alternately, GRPO then GAE, `--repeats` times after one
warm-up step each, so that load on a shared machine hits both alike; the median of each and
their ratio are reported with torch's thread count and the load average.

    python benchmarks/ppo_critic.py [--size small] [--prompts 8] [--group-size 4]
        [--prompt 32] [--completion 32] [--minibatches 2] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time

import torch
from host import host_line

import posttrain
from posttrain.backends.local import LocalBackend
from posttrain.data.trajectories import TokenSegment, Trajectory, TrajectoryGroup
from posttrain.models.tiny import make_tiny_model


def make_groups(args: argparse.Namespace) -> list[TrajectoryGroup]:
    rng = random.Random(0)
    groups = []
    for _ in range(args.prompts):
        prompt = TokenSegment(tuple(rng.randrange(3, 250) for _ in range(args.prompt)))
        trajectories = []
        for _ in range(args.group_size):
            sampled = TokenSegment(
                tuple(rng.randrange(3, 250) for _ in range(args.completion)),
                trainable=True,
                logprobs=tuple(-5.5 + rng.random() for _ in range(args.completion)),
            )
            trajectories.append(Trajectory((prompt, sampled), reward=float(rng.random() > 0.5)))
        groups.append(TrajectoryGroup(tuple(trajectories)))
    return groups


async def measure(args: argparse.Namespace, base: str, path: str) -> dict[str, list[float]]:
    backend = LocalBackend(path)
    model = posttrain.TrainableModel(name="ppo", project="bench", base_model=base, lora_rank=8)
    await model.register(backend)
    groups = make_groups(args)
    common = {"loss": "ppo", "num_minibatches": args.minibatches, "save_checkpoint": False}
    kinds = {"grpo": {}, "gae": {"advantage_estimator": "gae"}}
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    for round_ in range(args.repeats + 1):
        for kind, extra in kinds.items():
            began = time.perf_counter()
            await backend.train(model, groups, learning_rate=1e-5, **common, **extra)
            if round_ > 0:  # the first round warms up (and makes the critic)
                seconds[kind].append(time.perf_counter() - began)
    await backend.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--size", default="small", choices=["tiny", "mini", "small"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--completion", type=int, default=32)
    parser.add_argument("--minibatches", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(host_line(), flush=True)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        base = str(make_tiny_model(f"{tmp}/model", size=args.size))
        seconds = asyncio.run(measure(args, base, f"{tmp}/runs"))
    grpo, gae = (statistics.median(seconds[k]) for k in ("grpo", "gae"))
    print(
        f"PPO step on tiny '{args.size}' (LoRA 8): {args.prompts}x{args.group_size} completions "
        f"of {args.prompt}+{args.completion} tokens, {args.minibatches} mini-batches"
    )
    print(f"  grpo: median {grpo:.2f}s  ({', '.join(f'{s:.2f}' for s in seconds['grpo'])})")
    print(
        f"  gae (with critic): median {gae:.2f}s  ({', '.join(f'{s:.2f}' for s in seconds['gae'])})"
    )
    print(f"  gae / grpo step time: {gae / grpo:.2f}x")
    print(f"  torch threads {torch.get_num_threads()}, load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
