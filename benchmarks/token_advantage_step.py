"""RL step time of `gtpo_sepa` with `shannon_entropy` against plain GRPO, on the `small` model.

One step, timed whole: `sample_many` of prompts x group_size completions on the model's
LocalBackend client (with per-token entropies for gtpo_sepa, without for GRPO), rewards, then
`backend.train` (advantages, datums, forward_backward, optim_step). gtpo_sepa adds the
entropies in the sampler (one softmax pass over each decode step's logits), the uncertainty,
planning-token detection over the decoded tokens and the transform in the trainer. Both run
on the same registered model, alternating each round, so a shared CPU slows both alike; the
figure is the median step time of each, and their ratio. Threads: torch's intra-op threads
come from OMP_NUM_THREADS (printed); the reference figures use OMP_NUM_THREADS=2.

    OMP_NUM_THREADS=2 python benchmarks/token_advantage_step.py [--prompts 8] [--group 8]
        [--tokens 32] [--rounds 3] [--size small]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from host import host_line

from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.data.trajectories import TokenSegment, Trajectory, TrajectoryGroup
from posttrain.models.tiny import tiny_model_path
from posttrain.types import ModelInput, SamplingParams

VARIANTS: dict[str, dict[str, object]] = {
    "grpo": {},
    "gtpo_sepa+shannon_entropy": {
        "token_transform": "gtpo_sepa",
        "uncertainty_kind": "shannon_entropy",
        "sepa_delay_steps": 0,
    },
}


def groups_of(prompts: list[list[int]], responses, step: int) -> list[TrajectoryGroup]:
    """Rewards from the completion's tokens (a fixed pseudo-random rule): varied per group."""
    out = []
    for prompt, response in zip(prompts, responses, strict=True):
        trajectories = [
            Trajectory(
                (
                    TokenSegment(tuple(prompt)),
                    TokenSegment(
                        tuple(s.tokens),
                        True,
                        s.logprobs,
                        entropies=s.entropies,
                    ),
                ),
                reward=float((sum(s.tokens) + step) % 3 == 0),
            )
            for s in response.sequences
        ]
        out.append(TrajectoryGroup(tuple(trajectories)))
    return out


async def step(
    backend: LocalBackend, model: TrainableModel, args: argparse.Namespace, variant: str, k: int
) -> float:
    options = VARIANTS[variant]
    client = backend.client(model)
    gen = torch.Generator().manual_seed(k)
    prompts = [torch.randint(3, 250, (16,), generator=gen).tolist() for _ in range(args.prompts)]
    params = SamplingParams(
        max_tokens=args.tokens, seed=k, stop=[], entropies="uncertainty_kind" in options
    )
    start = time.perf_counter()
    responses = client.sample_many(
        [ModelInput.from_ints(p) for p in prompts], args.group, params
    ).result()
    await backend.train(
        model,
        groups_of(prompts, responses, k),
        learning_rate=1e-5,
        save_checkpoint=False,
        **options,  # pyright: ignore[reportArgumentType]
    )
    return time.perf_counter() - start


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        backend = LocalBackend(Path(tmp))
        model = TrainableModel(
            name="bench", project="bench", base_model=str(tiny_model_path(size=args.size)),
            lora_rank=8,
        )  # fmt: skip
        await model.register(backend)
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for variant in VARIANTS:  # warm-up: kernels, thread pools, tokenizer caches
            await step(backend, model, args, variant, 10_000)
        for k in range(args.rounds):
            for variant in VARIANTS if k % 2 == 0 else reversed(VARIANTS):
                times[variant].append(await step(backend, model, args, variant, k))
        await backend.close()
    medians = {v: statistics.median(t) for v, t in times.items()}
    for variant, seconds in medians.items():
        print(f"  {variant:<27} median step {seconds:6.3f} s   all {times[variant]}")
    ratio = medians["gtpo_sepa+shannon_entropy"] / medians["grpo"]
    print(f"gtpo_sepa+shannon_entropy / grpo step time: {ratio:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description="gtpo_sepa+shannon_entropy vs GRPO step time.")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", choices=["tiny", "mini", "small"], default="small")
    args = parser.parse_args()
    print(host_line(), flush=True)
    threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    print(
        f"{args.size} model, LoRA 8, fp32, {args.prompts} prompts x {args.group} samples x "
        f"{args.tokens} tokens; torch threads {torch.get_num_threads()} "
        f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')}); "
        f"1-min load average {os.getloadavg()[0]:.2f}"
    )
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
