"""Asynchronous RL against synchronous: steps/s of `rl_steps` with `max_off_policy_steps` 1
and 0, sampling through an engine in a process of its own, on the `small` tiny model (29.8M
parameters, fp32, LoRA 8), 8 prompts x 8 samples x 32 tokens a step.

The trainer runs `--trainer-threads` torch threads in this process and the engine its own
`--engine-threads` in its worker, so on 2 cores (1 + 1) sampling step k+1 and training step k
can run at the same time. The two settings take turns, `--rounds` times each, in one run.

    python benchmarks/async_rl.py [--engine pytorch|vllm] [--vllm-python .venv-vllm/bin/python]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from contextlib import aclosing
from pathlib import Path

import torch
from host import host_line

import posttrain
from posttrain.data.trajectories import TrajectoryGroup
from posttrain.jobs.pipeline import rl_steps
from posttrain.models.tiny import tiny_model_path
from posttrain.types import SamplingParams

WORDS = ["abc", "hello", "world", "xyz", "posttrain", "engine", "tokens", "reward"]


async def run(args: argparse.Namespace, ahead: int, root: Path) -> float:
    """Seconds per step of `args.steps` steps (the first, warming up, left out)."""
    inference: dict[str, object] = {"threads": args.engine_threads}
    if args.engine == "vllm":
        inference.update(engine="vllm", python=args.vllm_python, kv_cache_mb=256)
    else:
        inference.update(devices="cpu,cpu")
    backend = posttrain.LocalBackend(root / f"n{ahead}-{time.time_ns()}", inference=inference)
    model = posttrain.TrainableModel(
        name="m", project="b", base_model=str(tiny_model_path(size=args.size)), lora_rank=8, seed=0
    )
    await model.register(backend)
    sampler = backend.sampling_client(model)

    async def sample(k: int) -> list[TrajectoryGroup]:
        builders = [posttrain.TrajectoryBuilder(sampler.tokenizer) for _ in WORDS]
        prompts = [
            b.prompt({"role": "user", "content": w}) for b, w in zip(builders, WORDS, strict=True)
        ]
        params = SamplingParams(max_tokens=32, seed=k, stop=[])
        responses = await sampler.sample_many(prompts, 8, params)
        groups = []
        for builder, response in zip(builders, responses, strict=True):
            group = []
            for sequence in response.sequences:
                turn = builder.fork()
                text = turn.completion(sequence)
                group.append(turn.build(reward=sum(c.islower() for c in text) / len(text)))
            groups.append(TrajectoryGroup(tuple(group), metadata={}))
        return groups

    times = []
    try:
        began = time.perf_counter()
        steps = rl_steps(
            backend,
            model,
            sample,
            steps=args.steps,
            max_off_policy_steps=ahead,
            options=lambda k: {"learning_rate": 1e-3, "save_checkpoint": False},
        )
        async with aclosing(steps) as trained_steps:
            async for _ in trained_steps:
                now = time.perf_counter()
                times.append(now - began)
                began = now
    finally:
        await backend.close()
    return statistics.mean(times[1:])


async def main() -> None:
    parser = argparse.ArgumentParser(description="asynchronous vs synchronous RL steps")
    parser.add_argument("--engine", choices=["pytorch", "vllm"], default="pytorch")
    parser.add_argument("--vllm-python", default=os.environ.get("POSTTRAIN_VLLM_PYTHON"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--size", default="small", choices=["tiny", "mini", "small"], help="the tiny model's size"
    )
    parser.add_argument("--trainer-threads", type=int, default=1)
    parser.add_argument("--engine-threads", type=int, default=1)
    args = parser.parse_args()
    print(host_line(), flush=True)
    torch.set_num_threads(args.trainer_threads)
    print(
        f"engine {args.engine}: trainer {args.trainer_threads} thread(s), engine "
        f"{args.engine_threads}; {args.size} model, LoRA 8, 8x8x32; load average {os.getloadavg()[0]:.1f}"
    )
    root = Path(tempfile.mkdtemp(prefix="posttrain-async-"))
    seconds: dict[int, list[float]] = {0: [], 1: []}
    for round_index in range(args.rounds):
        for ahead in (0, 1) if round_index % 2 == 0 else (1, 0):
            seconds[ahead].append(await run(args, ahead, root))
            print(
                f"  round {round_index + 1}, max_off_policy_steps={ahead}: "
                f"{seconds[ahead][-1]:.2f} s a step"
            )
    sync, overlap = statistics.median(seconds[0]), statistics.median(seconds[1])
    print(
        f"synchronous {sync:.2f} s a step, asynchronous (1 step ahead) {overlap:.2f} s: "
        f"{sync / overlap:.2f}x the steps/s; load average {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    asyncio.run(main())
