"""`evaluate`: a model's accuracy (greedy) or pass@k (n samples) on a task's problems.

```python
sampler = backend.sampling_client(model)
result = await posttrain.evaluate(sampler, task, max_tokens=16)            # greedy, held out
result = await posttrain.evaluate(sampler, task, n=8, k=4, max_tokens=16)  # pass@4 of 8
```

A completion is correct when its reward is at least 1 (every built-in reward gives 1 for a
right answer and less otherwise). Prompts are the problems' chats rendered by the tokenizer's
chat template; each completion is scored on its text without the end-of-turn tokens it
stopped on, with its stop reason ("length" when cut by `max_tokens`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass

from posttrain.inference.protocol import Sampler
from posttrain.rollouts.builder import TrajectoryBuilder
from posttrain.tasks.protocol import Problem, Task
from posttrain.tasks.rewards import score_group
from posttrain.tokenizer import Tokenizer, TurnClosing, as_tokenizer, assistant_closing
from posttrain.types import SampledSequence, SamplingParams


@dataclass(frozen=True)
class Evaluation:
    """How a model did on `problems`: per problem, `n` completions with their rewards."""

    accuracy: float  # fraction of all completions that are correct (reward >= 1)
    pass_at_k: float  # mean over problems of the unbiased pass@k estimate (Chen et al., 2021)
    k: int
    mean_reward: float
    problems: list[Problem]
    completions: list[list[str]]  # [problem][sample]
    rewards: list[list[float]]  # [problem][sample]


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Chance that at least one of k of the n samples is correct: 1 - C(n-c, k) / C(n, k)."""
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def completion_text(
    tokenizer: Tokenizer,
    sequence: SampledSequence,
    closing: TurnClosing,
    stop: Sequence[str] = (),
) -> str:
    """The completion without the end of turn it stopped on: the template's closing through its
    EOS (Llama 2's " " EOS) when it ends with all of it, else its final token; sampled with stop
    strings `stop`, the text before the first of them. Any other special token stays visible as
    text, so a completion that emits one never equals an answer."""
    tokens = sequence.tokens
    if sequence.stop_reason == "stop" and stop:
        text = str(tokenizer.decode(tokens, skip_special_tokens=False))
        cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
        return text[: min(cuts)] if cuts else text
    if sequence.stop_reason == "stop":
        end = closing.through_end
        tokens = tokens[: -len(end)] if tuple(tokens[-len(end) :]) == end else tokens[:-1]
    return str(tokenizer.decode(tokens, skip_special_tokens=False))


def prompt_builders(
    tokenizer: Tokenizer, problems: Sequence[Problem], closing: TurnClosing
) -> list[TrajectoryBuilder]:
    """One builder per problem, holding its chat rendered with the generation prompt."""
    builders = [TrajectoryBuilder(tokenizer, closing=closing) for _ in problems]
    for builder, problem in zip(builders, problems, strict=True):
        builder.prompt(*problem.chat())
    return builders


async def evaluate(
    sampler: Sampler,
    task: Task,
    problems: Sequence[Problem] | None = None,
    *,
    n: int = 1,
    k: int | None = None,
    max_tokens: int = 64,
    temperature: float | None = None,
    held_out: int = 200,
    seed: int = 0,
    stop: str | None = None,
) -> Evaluation:
    """Accuracy and pass@k of the sampler's model on `problems` (default: `held_out` problems
    of the task's held-out split, chosen by `seed`).

    `n` completions per problem (`k` defaults to `n`); `temperature` defaults to 0 (greedy) for
    n=1 and 1 otherwise; a completion ends at `stop` when given, else at the end of turn. A
    reward that fails is an error naming the reward and the problem.
    """
    k = n if k is None else k
    if n < 1 or not 1 <= k <= n:
        raise ValueError(f"need n >= 1 and 1 <= k <= n, got n={n}, k={k}")
    if temperature is None:
        temperature = 0.0 if n == 1 else 1.0
    chosen = list(task.held_out(seed, held_out) if problems is None else problems)
    if not chosen:
        raise ValueError("evaluate() got no problems")
    tokenizer = as_tokenizer(sampler.tokenizer)
    closing = assistant_closing(tokenizer)
    prompts = [b.tokens for b in prompt_builders(tokenizer, chosen, closing)]
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, stop=stop)
    responses = await sampler.sample_many(prompts, n, params)
    completions = [
        [
            (completion_text(tokenizer, s, closing, params.stop_strings()), s)
            for s in response.sequences
        ]
        for response in responses
    ]
    results = await asyncio.gather(
        *(
            score_group(task, problem, [t for t, _ in row], [s.stop_reason for _, s in row])
            for problem, row in zip(chosen, completions, strict=True)
        )
    )
    rewards = [[_reward(result) for result in row] for row in results]
    scored = [r for row in rewards for r in row]
    correct = [sum(r >= 1.0 for r in row) for row in rewards]
    return Evaluation(
        accuracy=sum(correct) / len(scored),
        pass_at_k=sum(pass_at_k(len(row), c, k) for row, c in zip(rewards, correct, strict=True))
        / len(chosen),
        k=k,
        mean_reward=sum(scored) / len(scored),
        problems=chosen,
        completions=[[text for text, _ in row] for row in completions],
        rewards=rewards,
    )


def _reward(result: float | BaseException) -> float:
    """A reward, or its error raised (evaluation tolerates no failed reward)."""
    if isinstance(result, BaseException):
        raise result
    return result
