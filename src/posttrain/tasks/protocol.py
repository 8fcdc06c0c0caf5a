"""What a task is: problems (a chat to answer, maybe a reference answer), a reward, and a
fixed held-out split.

For the built-in tasks every problem belongs to exactly one split, decided by a hash of its
prompt: about one problem in ten is held out. Training draws skip held-out problems and
evaluation draws only them, so the evaluation set is disjoint from every training prompt
whatever the seeds and sizes. (Dataset tasks have their own rule: `posttrain.tasks.dataset`.)
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeGuard

from posttrain.types import StopReason

# One problem in HELD_OUT_MODULUS goes to the held-out split.
HELD_OUT_MODULUS = 10
# Draws allowed per requested problem before concluding the split is too small.
_MAX_DRAWS_PER_PROBLEM = 200


# The methods (and attribute) an object needs to be a Task; `missing_methods` checks them.
TASK_METHODS = ("name", "make_prompts", "held_out", "reward", "solution")


@dataclass(frozen=True)
class Problem:
    """One problem: the chat to answer and, when known, its reference answer.

    `messages` is the chat the model answers (system, user, ... turns); empty means a single
    user message `prompt`. `prompt` is the problem's text either way (for a chat problem, its
    last user message), used in logs and by the built-in tasks' split. `source` says where the
    problem came from ("file.jsonl:12"), for errors; `info` holds the rest of its JSONL line,
    for a custom reward that needs more than the answer.
    """

    prompt: str
    answer: str | None = None
    messages: tuple[Mapping[str, str], ...] = field(default=(), hash=False)
    source: str = ""
    info: Mapping[str, object] = field(default_factory=dict[str, object], hash=False)

    def chat(self) -> list[dict[str, str]]:
        """The messages to sample the answer from."""
        if self.messages:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.prompt}]

    def where(self) -> str:
        """How errors name this problem: its file and line, else its prompt."""
        return f"the problem at {self.source}" if self.source else f"the problem {self.prompt!r}"

    def reference(self) -> str:
        """The reference answer; an error naming the problem when it has none."""
        if self.answer is None:
            raise ValueError(f"{self.where()} has no answer (it is needed as a reference here)")
        return self.answer


class Task(Protocol):
    """A task with a verifiable reward; see `posttrain.tasks.TASKS` for the built-in ones.

    `reward` may be a coroutine function (an `async def`): the job and `posttrain.evaluate`
    await what it returns. It must give a finite number; a completion counts as correct
    (accuracy, pass@k) when its reward is at least 1.

    Optionally a task also has `async def group_reward(problem, completions, stop_reasons) ->
    list[float]`, one score per completion, for a reward that compares a problem's completions
    (a group judge) or batches them (a reward model). Where it is present (and not None) the
    job and `evaluate` score each problem's completions with one call of it instead of
    `reward` per completion (`posttrain.tasks.rewards.score_group`).
    """

    @property
    def name(self) -> str:
        """A short name for logs and plots."""
        ...

    def make_prompts(self, rng: random.Random, n: int) -> list[Problem]:
        """`n` training problems (never held out; repeats possible)."""
        ...

    def held_out(self, seed: int, n: int) -> list[Problem]:
        """`n` distinct held-out problems, the same for the same seed."""
        ...

    def reward(
        self, problem: Problem, completion: str, stop_reason: StopReason
    ) -> float | Awaitable[float]:
        """Reward of a completion (its text without the final EOS) that ended with stop_reason."""
        ...

    def solution(self, problem: Problem) -> str:
        """The reference answer, used as the SFT warm-up target (`[sft] examples`)."""
        ...


def missing_methods(obj: object) -> list[str]:
    """What `obj` lacks of the Task protocol, in TASK_METHODS order (empty: it is a Task)."""
    missing = [] if isinstance(getattr(obj, "name", None), str) else ["name (a str)"]
    return missing + [n for n in TASK_METHODS[1:] if not callable(getattr(obj, n, None))]


def is_task(obj: object) -> TypeGuard[Task]:
    """Whether `obj` has all of the Task protocol (`missing_methods` says what it lacks)."""
    return not missing_methods(obj)


def is_held_out(problem: Problem) -> bool:
    """Whether `problem` is in the held-out split (a stable hash of its prompt)."""
    digest = hashlib.blake2b(problem.prompt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % HELD_OUT_MODULUS == 0


def is_correct(problem: Problem, completion: str, stop_reason: StopReason) -> bool:
    """Exactly the answer, then EOS (a completion cut by max_tokens is wrong)."""
    return stop_reason == "stop" and completion == problem.answer


def draw_training(
    draw: Callable[[random.Random], Problem], rng: random.Random, n: int
) -> list[Problem]:
    """`n` problems from `draw`, skipping held-out ones."""
    _check_count(n)
    problems: list[Problem] = []
    for _ in range(n * _MAX_DRAWS_PER_PROBLEM):
        if len(problems) == n:
            break
        problem = draw(rng)
        if not is_held_out(problem):
            problems.append(problem)
    return _enough(problems, n, "training")


def draw_held_out(draw: Callable[[random.Random], Problem], seed: int, n: int) -> list[Problem]:
    """`n` distinct held-out problems from `draw`, seeded by `seed`."""
    _check_count(n)
    rng = random.Random(f"held-out:{seed}")
    problems: dict[str, Problem] = {}
    for _ in range(n * _MAX_DRAWS_PER_PROBLEM):
        if len(problems) == n:
            break
        problem = draw(rng)
        if is_held_out(problem):
            problems.setdefault(problem.prompt, problem)
    return _enough(list(problems.values()), n, "held-out")


def _check_count(n: int) -> None:
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")


def _enough(problems: list[Problem], n: int, split: str) -> list[Problem]:
    if len(problems) < n:
        raise ValueError(
            f"n={n} is more {split} problems than this task can supply "
            f"(found {len(problems)}); ask for fewer"
        )
    return problems
