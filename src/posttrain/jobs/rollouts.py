"""Task rollouts for the job: one batched sampling call per RL step, and held-out evaluation."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from posttrain.backends.sampling import SamplingClient
from posttrain.jobs.sft_data import conversation_to_trajectory
from posttrain.rollout import TrajectoryBuilder, TurnClosing, assistant_closing
from posttrain.tasks import Problem, Task, is_correct
from posttrain.types import SampledSequence, SamplingParams, Trajectory, TrajectoryGroup


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from `parts`, stable across processes (unlike `hash`)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def user_message(problem: Problem) -> dict[str, str]:
    return {"role": "user", "content": problem.prompt}


def completion_text(
    tokenizer: PreTrainedTokenizerBase, sequence: SampledSequence, closing: TurnClosing
) -> str:
    """The completion without the end of turn it stopped on: the template's closing through its
    EOS (Llama 2's " " EOS) when it ends with all of it, else its final token. Any other
    special token stays visible as text, so a completion that emits one never equals an answer."""
    tokens = sequence.tokens
    if sequence.stop_reason == "stop":
        end = closing.through_end
        tokens = tokens[: -len(end)] if tuple(tokens[-len(end) :]) == end else tokens[:-1]
    return str(tokenizer.decode(tokens, skip_special_tokens=False))


def sft_examples(
    task: Task, problems: Sequence[Problem], tokenizer: PreTrainedTokenizerBase
) -> list[Trajectory]:
    """Warm-up conversations: each problem answered by the task's reference solution."""
    closing = assistant_closing(tokenizer)
    return [
        conversation_to_trajectory(
            [user_message(p), {"role": "assistant", "content": task.solution(p)}],
            tokenizer,
            closing,
        )
        for p in problems
    ]


async def sample_groups(
    sampler: SamplingClient,
    task: Task,
    problems: Sequence[Problem],
    group_size: int,
    params: SamplingParams,
) -> list[TrajectoryGroup]:
    """`group_size` completions of each problem, all in one `sample_many` call, rewarded."""
    tokenizer = sampler.tokenizer
    closing = assistant_closing(tokenizer)
    prompted = [TrajectoryBuilder(tokenizer, closing=closing) for _ in problems]
    prompts = [b.prompt(user_message(p)) for b, p in zip(prompted, problems, strict=True)]
    responses = await sampler.sample_many(prompts, group_size, params)
    groups: list[TrajectoryGroup] = []
    for problem, response, base in zip(problems, responses, prompted, strict=True):
        trajectories: list[Trajectory] = []
        for sequence in response.sequences:
            builder = base.fork()
            builder.completion(sequence)
            text = completion_text(tokenizer, sequence, closing)  # type: ignore[arg-type]
            correct = is_correct(problem, text, sequence.stop_reason)
            trajectories.append(
                builder.build(
                    task.reward(problem, text, sequence.stop_reason),
                    metrics={
                        "accuracy": float(correct),
                        "completion_tokens": float(len(sequence.tokens)),
                    },
                    metadata={
                        "prompt": problem.prompt,
                        "answer": problem.answer,
                        "completion": text,
                    },
                )
            )
        groups.append(TrajectoryGroup(tuple(trajectories)))
    return groups


@dataclass(frozen=True)
class Evaluation:
    """Greedy accuracy on a problem set, with each completion for inspection."""

    accuracy: float
    completions: list[str]


async def evaluate(
    sampler: SamplingClient, task: Task, problems: Sequence[Problem], max_tokens: int
) -> Evaluation:
    """Greedy (temperature 0) accuracy of the current weights on `problems`."""
    tokenizer = sampler.tokenizer
    closing = assistant_closing(tokenizer)
    prompts = [TrajectoryBuilder(tokenizer).prompt(user_message(p)) for p in problems]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=0)
    responses = await sampler.sample_many(prompts, 1, params)
    texts: list[str] = []
    correct = 0
    for problem, response in zip(problems, responses, strict=True):
        sequence = response.sequences[0]
        text = completion_text(tokenizer, sequence, closing)  # type: ignore[arg-type]
        correct += is_correct(problem, text, sequence.stop_reason)
        texts.append(text)
    return Evaluation(accuracy=correct / len(problems), completions=texts)
