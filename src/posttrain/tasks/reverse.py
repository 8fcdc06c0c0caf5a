"""`reverse`: write a random 3-6 letter lowercase string backwards (``abcd`` -> ``dcba``)."""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from posttrain.tasks.protocol import Problem, draw_held_out, draw_training, is_correct
from posttrain.types import StopReason


@dataclass(frozen=True)
class ReverseTask:
    """Reverse a string of `min_length`..`max_length` lowercase letters; reward 1 if exact."""

    name: str = "reverse"
    min_length: int = 3
    max_length: int = 6
    partial_credit: float = 0.0  # weight of the per-position match score of a wrong answer

    def __post_init__(self) -> None:
        # Below 1, a wrong answer's reward stays below 1: "reward >= 1" is "correct".
        if not 0 <= self.partial_credit <= 1:
            raise ValueError(f"partial_credit must be in [0, 1], got {self.partial_credit}")
        if not 1 <= self.min_length <= self.max_length:
            raise ValueError(
                f"need 1 <= min_length <= max_length, got {self.min_length}, {self.max_length}"
            )

    def draw(self, rng: random.Random) -> Problem:
        length = rng.randint(self.min_length, self.max_length)
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(length))
        return Problem(prompt=f"reverse {word}", answer=word[::-1])

    def make_prompts(self, rng: random.Random, n: int) -> list[Problem]:
        return draw_training(self.draw, rng, n)

    def held_out(self, seed: int, n: int) -> list[Problem]:
        return draw_held_out(self.draw, seed, n)

    def reward(self, problem: Problem, completion: str, stop_reason: StopReason) -> float:
        if is_correct(problem, completion, stop_reason):
            return 1.0
        if stop_reason != "stop" or not self.partial_credit:
            return 0.0
        answer = problem.reference()
        matches = sum(a == b for a, b in zip(completion, answer, strict=False))
        return self.partial_credit * matches / max(len(completion), len(answer))

    def solution(self, problem: Problem) -> str:
        return problem.reference()
