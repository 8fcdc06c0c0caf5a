"""`addition`: the sum of two numbers below `limit` (``23+58=`` -> ``81``)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from posttrain.tasks.protocol import Problem, draw_held_out, draw_training, is_correct
from posttrain.types import StopReason


@dataclass(frozen=True)
class AdditionTask:
    """Add two integers in [0, limit); reward 1 for the exact decimal sum."""

    name: str = "addition"
    limit: int = 100

    def __post_init__(self) -> None:
        if self.limit < 2:
            raise ValueError(f"limit must be >= 2, got {self.limit}")

    def draw(self, rng: random.Random) -> Problem:
        a, b = rng.randrange(self.limit), rng.randrange(self.limit)
        return Problem(prompt=f"{a}+{b}=", answer=str(a + b))

    def make_prompts(self, rng: random.Random, n: int) -> list[Problem]:
        return draw_training(self.draw, rng, n)

    def held_out(self, seed: int, n: int) -> list[Problem]:
        return draw_held_out(self.draw, seed, n)

    def reward(self, problem: Problem, completion: str, stop_reason: StopReason) -> float:
        return 1.0 if is_correct(problem, completion, stop_reason) else 0.0

    def solution(self, problem: Problem) -> str:
        return problem.reference()
