"""An ART-style OpenAI-client rollout loop against LocalBackend's own sampler, same work.

Each RL step samples `--prompts` chat prompts x `--samples` completions of up to
`--new-tokens` tokens on the `mini` tiny model (LoRA 8, float32), rewards them, and trains one
step on them (no checkpoint). The two sides differ only in how they sample:

- openai: ART's loop. One rollout coroutine per completion sends a chat completion through
  `model.openai_client()` (the in-process endpoint, HTTP on loopback), makes the choice an
  `art.Trajectory`, and `gather_trajectory_groups` runs them all at once (`asyncio.gather`);
  with `--per-request n`, each request asks for n completions instead of 1.
- local: one `backend.sampling_client(model).sample_many(prompts, samples)` call, and the
  trajectories built from its sequences.

The sides alternate within one run (the machine may be shared) on the same model. Prints the
thread settings, each side's median rollout time and step time (rollouts + train), and their
ratios (openai / local; lower is better, goal <= 1.3 for the step).

    python benchmarks/openai_rollouts.py [--prompts 8] [--samples 8] [--new-tokens 16]
        [--per-request 1] [--rounds 5] [--size mini] [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

from host import host_line

import posttrain as art
from posttrain.cli.thread_report import thread_report
from posttrain.data.trajectories import TokenSegment
from posttrain.engine.threads import configure_torch_threads
from posttrain.models.tiny import tiny_model_path
from posttrain.types import SamplingParams


def reward(text: str) -> float:
    return sum(c.islower() for c in text) / max(len(text), 1)


def chats(count: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"reverse the word number {i}"}] for i in range(count)]


async def openai_groups(
    model: art.TrainableModel, args: argparse.Namespace
) -> list[art.TrajectoryGroup]:
    async def rollouts(messages: list[dict[str, str]], n: int) -> list[art.Trajectory]:
        client = model.openai_client()
        completion = await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=messages,  # pyright: ignore[reportArgumentType]
            max_tokens=args.new_tokens,
            n=n,
        )
        return [
            art.Trajectory(
                messages_and_choices=[*messages, choice],
                reward=reward(choice.message.content or ""),
            )
            for choice in completion.choices
        ]

    async def one(messages: list[dict[str, str]]) -> art.Trajectory:
        return (await rollouts(messages, 1))[0]

    async def group_of_n(messages: list[dict[str, str]]) -> art.TrajectoryGroup:
        requests = args.samples // args.per_request
        parts = await asyncio.gather(
            *(rollouts(messages, args.per_request) for _ in range(requests))
        )
        return art.TrajectoryGroup([t for part in parts for t in part])

    if args.per_request == 1:
        items = [
            art.TrajectoryGroup(one(m) for _ in range(args.samples)) for m in chats(args.prompts)
        ]
        return await art.gather_trajectory_groups(items, pbar_desc=None)
    return await art.gather_trajectory_groups(
        [group_of_n(m) for m in chats(args.prompts)], pbar_desc=None
    )


async def local_groups(
    backend: art.LocalBackend, model: art.TrainableModel, args: argparse.Namespace
) -> list[art.TrajectoryGroup]:
    sampler = backend.sampling_client(model)
    tokenizer: Any = sampler.tokenizer
    prompts = [
        tokenizer.apply_chat_template(
            m, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for m in chats(args.prompts)
    ]
    params = SamplingParams(max_tokens=args.new_tokens)
    responses = await sampler.sample_many(prompts, args.samples, params)
    return [
        art.TrajectoryGroup(
            art.Trajectory(
                (
                    TokenSegment(tuple(prompt)),
                    TokenSegment(tuple(s.tokens), True, tuple(s.logprobs or ())),
                ),
                reward(tokenizer.decode(s.tokens, skip_special_tokens=True)),
            )
            for s in response.sequences
        )
        for prompt, response in zip(prompts, responses, strict=True)
    ]


async def timed_step(
    backend: art.LocalBackend,
    model: art.TrainableModel,
    rollouts: Callable[[], Awaitable[list[art.TrajectoryGroup]]],
) -> tuple[float, float, int]:
    start = time.perf_counter()
    groups = await rollouts()
    sampled = time.perf_counter() - start
    await backend.train(model, groups, learning_rate=1e-4, save_checkpoint=False)
    tokens = sum(t.num_trainable_tokens for g in groups for t in g)
    return sampled, time.perf_counter() - start, tokens


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="posttrain-bench-") as tmp:
        backend = art.LocalBackend(tmp)
        base = str(tiny_model_path(size=args.size))
        model = art.TrainableModel(name="bench", project="p", base_model=base, lora_rank=8)
        await model.register(backend)
        sides: dict[str, Callable[[], Awaitable[list[art.TrajectoryGroup]]]] = {
            "openai": lambda: openai_groups(model, args),
            "local": lambda: local_groups(backend, model, args),
        }
        for rollouts in sides.values():  # warm-up: the endpoint starts, caches fill
            await timed_step(backend, model, rollouts)
        times: dict[str, list[tuple[float, float, int]]] = {name: [] for name in sides}
        for _ in range(args.rounds):
            for name, rollouts in sides.items():
                times[name].append(await timed_step(backend, model, rollouts))
        await backend.close()

    print(thread_report().describe())
    print(
        f"{args.size} model, LoRA 8, fp32; {args.prompts} prompts x {args.samples} completions "
        f"of up to {args.new_tokens} tokens, {args.per_request} completion(s) per OpenAI "
        f"request; {args.rounds} alternating rounds, medians"
    )
    medians = {
        name: [statistics.median(t[i] for t in rows) for i in range(3)]
        for name, rows in times.items()
    }
    for name, (sampled, step, tokens) in medians.items():
        print(
            f"{name:7s} rollouts {sampled:.3f} s | step {step:.3f} s | {tokens:.0f} sampled tokens"
        )
    openai, local = medians["openai"], medians["local"]
    print(
        f"ratio openai / local: rollouts {openai[0] / local[0]:.2f}x, step {openai[1] / local[1]:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="OpenAI-client rollouts vs sample_many.")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--per-request", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size", default="mini", choices=["tiny", "mini", "small"])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    print(host_line(), flush=True)
    if args.samples % args.per_request:
        parser.error("--samples must be a multiple of --per-request")
    os.environ["POSTTRAIN_NUM_THREADS"] = str(args.threads)
    configure_torch_threads()  # as posttrain's commands do (it parks the OpenMP pool)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
