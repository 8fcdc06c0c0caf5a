"""Task rollouts for the job: one batched sampling call per RL step, rewarded, with a bound on
rollouts whose reward (or, for an environment's episodes, whose environment) fails.

A rollout whose reward raises or is not a finite number is bad (a task's `group_reward` that
fails makes each of its problem's rollouts bad). Up to `max_bad_rollouts` (a
fraction of the step's rollouts) are counted and dropped whole: no trajectory is built for
them, and a group left empty is dropped too. More than that fails the step with the first
(in prompt order) bad rollout's error, before anything is trained.

Each trajectory's metadata names the policy version (model step) whose weights sampled it,
`"policy_version"`, where the engine reports one: asynchronous RL (`jobs.pipeline`) reads it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from posttrain.data.seeds import derive_seed
from posttrain.data.trajectories import (
    POLICY_VERSION,
    SAMPLING_TEMPERATURE,
    JSONScalar,
    Trajectory,
    TrajectoryGroup,
)
from posttrain.inference.protocol import Sampler
from posttrain.rollouts.evaluation import completion_text, prompt_builders
from posttrain.rollouts.gather import EpisodeError
from posttrain.rollouts.sft_data import conversation_to_trajectory
from posttrain.tasks import Problem, Task
from posttrain.tasks.rewards import RewardError, score_group
from posttrain.tokenizer import Tokenizer, as_tokenizer, assistant_closing
from posttrain.types import SamplingParams

__all__ = [
    "POLICY_VERSION",
    "SampledStep",
    "completion_text",
    "derive_seed",
    "sample_groups",
    "sft_examples",
]


def sft_examples(task: Task, problems: Sequence[Problem], tokenizer: Tokenizer) -> list[Trajectory]:
    """Warm-up conversations: each problem's chat answered by the task's reference solution."""
    closing = assistant_closing(tokenizer)
    return [
        conversation_to_trajectory(
            [*p.chat(), {"role": "assistant", "content": task.solution(p)}], tokenizer, closing
        )
        for p in problems
    ]


@dataclass(frozen=True)
class SampledStep:
    """One RL step's rewarded groups, and how many rollouts were dropped as bad."""

    groups: list[TrajectoryGroup]
    bad_rollouts: int
    rollouts: int  # sampled, bad ones included
    # What the step's rewards cost (a judge's requests, cache hits, seconds), for its metrics row.
    metrics: dict[str, float] = field(default_factory=dict[str, float])


async def sample_groups(
    sampler: Sampler,
    task: Task,
    problems: Sequence[Problem],
    group_size: int,
    params: SamplingParams,
    *,
    max_bad_rollouts: float = 0.0,
) -> SampledStep:
    """`group_size` completions of each problem, all in one `sample_many` call, rewarded."""
    tokenizer = as_tokenizer(sampler.tokenizer)
    closing = assistant_closing(tokenizer)
    prompted = prompt_builders(tokenizer, problems, closing)
    responses = await sampler.sample_many([b.tokens for b in prompted], group_size, params)
    texts = [
        [completion_text(tokenizer, s, closing, params.stop_strings()) for s in response.sequences]
        for response in responses
    ]
    scored = await asyncio.gather(
        *(
            score_group(task, problem, row, [s.stop_reason for s in response.sequences])
            for problem, response, row in zip(problems, responses, texts, strict=True)
        )
    )
    results = [result for row in scored for result in row]
    bad = [r for r in results if isinstance(r, BaseException)]
    check_bad_rollouts(bad, len(results), max_bad_rollouts)
    rewards = iter(results)
    groups: list[TrajectoryGroup] = []
    for problem, response, base, row in zip(problems, responses, prompted, texts, strict=True):
        trajectories: list[Trajectory] = []
        for sequence, text in zip(response.sequences, row, strict=True):
            reward = next(rewards)
            if isinstance(reward, BaseException):
                continue  # dropped whole: never a trajectory without its reward
            builder = base.fork()
            builder.completion(sequence)
            metadata: dict[str, JSONScalar] = {
                "prompt": problem.prompt,
                "answer": problem.answer,
                "completion": text,
            }
            if response.policy_version is not None:
                metadata[POLICY_VERSION] = response.policy_version
                metadata[SAMPLING_TEMPERATURE] = params.temperature
            trajectories.append(
                builder.build(
                    reward,
                    metrics={
                        "accuracy": float(reward >= 1.0),
                        "completion_tokens": float(len(sequence.tokens)),
                    },
                    metadata=metadata,
                )
            )
        if trajectories:
            groups.append(TrajectoryGroup(tuple(trajectories)))
    return SampledStep(groups, len(bad), len(results))


def check_bad_rollouts(bad: Sequence[BaseException], total: int, max_fraction: float) -> None:
    """Raise the first bad rollout's error when more than `max_fraction` of `total` are bad
    (or all of them are); anything but a RewardError or an EpisodeError (an environment's
    failure) is raised as it is."""
    for error in bad:
        if not isinstance(error, RewardError | EpisodeError):
            raise error  # not the reward's fault (a bug, a cancellation): never tolerated
    if not bad:
        return
    if len(bad) > max_fraction * total or len(bad) == total:
        raise type(bad[0])(
            f"{bad[0]} ({len(bad)} of {total} rollouts of this step failed; [rl] "
            f"max_bad_rollouts = {max_fraction} tolerates {int(max_fraction * total)})"
        ) from bad[0]
