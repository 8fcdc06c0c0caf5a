"""RL with the backend-first API: register a model, roll out groups, backend.train, model.log.

Run: python recipes/rl_backend.py --steps 20 [--base-model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import string
import tempfile

import posttrain


async def rollout(sampler, word: str, group_size: int) -> posttrain.TrajectoryGroup:
    """One prompt, `group_size` completions: reward 1 for the exact reversal, else 0.5 x the
    share of lowercase letters (so an untrained model's samples differ in reward)."""
    builder = posttrain.TrajectoryBuilder(sampler.tokenizer)
    prompt = builder.prompt({"role": "user", "content": f"reverse: {word}"})
    params = posttrain.SamplingParams(max_tokens=12, temperature=1.0)
    response = await sampler.sample(prompt, group_size, params)
    trajectories = []
    for sequence in response.sequences:
        turn = builder.fork()
        text = turn.completion(sequence)
        correct = sequence.stop_reason == "stop" and text.strip() == word[::-1]
        letters = sum(c in string.ascii_lowercase for c in text) / max(1, len(text))
        trajectories.append(turn.build(reward=1.0 if correct else 0.5 * letters))
    return posttrain.TrajectoryGroup(tuple(trajectories))


async def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-model")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--path", default=tempfile.mkdtemp(prefix="posttrain-recipe-"))
    args = parser.parse_args(argv)
    base = args.base_model or str(posttrain.make_tiny_model(tempfile.mkdtemp()))
    backend = posttrain.LocalBackend(args.path)
    model = posttrain.TrainableModel(
        name="reverser", project="recipes", base_model=base, lora_rank=None
    )
    await model.register(backend)
    rng = random.Random(0)
    metrics = []
    for _ in range(args.steps):
        words = ["".join(rng.choices("abcdefgh", k=rng.randint(3, 5))) for _ in range(8)]
        sampler = backend.sampling_client(model)
        groups = await posttrain.gather_groups(rollout(sampler, w, 8) for w in words)
        result = await backend.train(model, groups, learning_rate=2e-4, loss="ppo")
        await model.log(groups, metrics=result.metrics, step=result.step)
        metrics.append(dict(result.metrics))
        print(f"step {result.step:3d}  reward {result.metrics['reward']:.3f}")
    await backend.close()
    return metrics


if __name__ == "__main__":
    asyncio.run(main())
