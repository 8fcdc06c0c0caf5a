"""Steps the engine tests share: one RL step on a chat prompt, and the largest gap between an
engine's sampled logprobs and the trainer's teacher-forced logprobs of the same tokens."""

from __future__ import annotations

from collections.abc import Sequence

import torch

import posttrain
from posttrain.data.trajectories import TrajectoryGroup
from posttrain.types import ModelInput, SampleResponse, SamplingParams


async def train_one_step(
    backend: posttrain.LocalBackend | posttrain.RayBackend,
    model: posttrain.TrainableModel,
    *,
    content: str,
    seed: int,
    learning_rate: float,
) -> list[int]:
    """Sample 4 answers to `content` (reward = their index), train once; returns the prompt."""
    sampler = backend.sampling_client(model)
    builder = posttrain.TrajectoryBuilder(sampler.tokenizer)
    prompt = builder.prompt({"role": "user", "content": content})
    response = await sampler.sample(prompt, 4, SamplingParams(max_tokens=8, seed=seed))
    group = []
    for i, sequence in enumerate(response.sequences):
        turn = builder.fork()
        turn.completion(sequence)
        group.append(turn.build(reward=float(i)))
    await backend.train(
        model, [TrajectoryGroup(tuple(group))], learning_rate=learning_rate, save_checkpoint=False
    )
    return prompt


async def worst_logprob_gap(
    client: object, prompts: Sequence[Sequence[int]], responses: Sequence[SampleResponse]
) -> float:
    """max |sampled logprob - trainer logprob| over every sampled token of `responses`."""
    worst = 0.0
    for prompt, response in zip(prompts, responses, strict=True):
        for sequence in response.sequences:
            tokens = [*prompt, *sequence.tokens]
            scored = await client.compute_logprobs(ModelInput.from_ints(tokens))  # pyright: ignore[reportAttributeAccessIssue]
            want = torch.tensor([float(x) for x in scored[len(prompt) :]])
            assert sequence.logprobs is not None
            worst = max(worst, (torch.tensor(sequence.logprobs) - want).abs().max().item())
    return worst
