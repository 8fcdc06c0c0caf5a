"""What a built-in task is: problems with one exact answer, a reward, and a fixed held-out split.

Every problem belongs to exactly one split, decided by a hash of its prompt: about one problem
in ten is held out. Training draws skip held-out problems and evaluation draws only them, so
the evaluation set is disjoint from every training prompt whatever the seeds and sizes.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from posttrain.types import StopReason

# One problem in HELD_OUT_MODULUS goes to the held-out split.
HELD_OUT_MODULUS = 10
# Draws allowed per requested problem before concluding the split is too small.
_MAX_DRAWS_PER_PROBLEM = 200


@dataclass(frozen=True)
class Problem:
    """One prompt (the user message) and its exact answer (the assistant message)."""

    prompt: str
    answer: str


class Task(Protocol):
    """A task with a verifiable reward; see `posttrain.tasks.TASKS` for the built-in ones."""

    @property
    def name(self) -> str:
        """The task's key in `posttrain.tasks.TASKS`."""
        ...

    def make_prompts(self, rng: random.Random, n: int) -> list[Problem]:
        """`n` training problems (never held out; repeats possible)."""
        ...

    def held_out(self, seed: int, n: int) -> list[Problem]:
        """`n` distinct held-out problems, the same for the same seed."""
        ...

    def reward(self, problem: Problem, completion: str, stop_reason: StopReason) -> float:
        """Reward of a completion (its text without the final EOS) that ended with stop_reason."""
        ...

    def solution(self, problem: Problem) -> str:
        """The reference answer, used as the SFT warm-up target."""
        ...


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
