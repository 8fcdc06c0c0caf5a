"""`word-problems`: one-step stories on small numbers, for a real (pretrained) chat model.

"Mia has 7 shells and gets 5 more. How many shells does Mia have now?" -> 12. Each problem is
a chat: a system prompt, then the story. The reward reads the last number of the answer, so
"12", "Mia has 7 + 5 = 12 shells." and "The answer is 12." are all right, and an answer cut by
max_tokens is wrong: a model that rambles has to learn to finish.

The problems are generated from a seed: a name, a thing, an operation and its operands. The
held-out split is the built-in tasks' rule (a hash of the prompt, `tasks.protocol`), so no
held-out story is ever trained on; the same sums do occur in both splits, told about other
people and things.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from posttrain.tasks.protocol import Problem, draw_held_out, draw_training
from posttrain.tasks.rewards import number
from posttrain.types import StopReason

NAMES = ("Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Leo", "Emma", "Max", "Zoe", "Jack", "Nora")
THINGS = (
    *("apples", "books", "coins", "pens", "cards", "stickers"),
    *("marbles", "shells", "stamps", "cookies", "balloons", "pencils"),
)
# The story of each operation, and its answer.
OPERATIONS = ("+", "-", "*")
DEFAULT_SYSTEM_PROMPT = "Answer with the number only."


@dataclass(frozen=True)
class WordProblemsTask:
    """One-step word problems with operands up to `limit`; reward 1 for the right number.

    `operations` picks the stories: "+" (gets more), "-" (gives some away, leaving at least 1)
    and "*" (bags of things). Every number in a story is in 1..`limit`. `question` is the user
    message, `{story}` replaced by the story ("Question: {story}\nAnswer:" prompts a pretrained
    model without a chat template, which continues the text). `system_prompt` ("" for
    none: the chat template's own default) goes before each story.
    """

    name: str = "word-problems"
    operations: str = "+-"
    limit: int = 9
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    question: str = "{story}"

    def __post_init__(self) -> None:
        unknown = sorted(set(self.operations) - set(OPERATIONS))
        if unknown or not self.operations:
            raise ValueError(
                f"operations must be some of {''.join(OPERATIONS)!r}, got {self.operations!r}"
            )
        if "{story}" not in self.question:
            raise ValueError(
                f"question must contain {{story}}, where the story goes; got {self.question!r}"
            )
        if self.limit < 2:
            raise ValueError(f"limit must be >= 2, got {self.limit}")

    def draw(self, rng: random.Random) -> Problem:
        who, what = rng.choice(NAMES), rng.choice(THINGS)
        operation = rng.choice(self.operations)
        if operation == "+":
            a, b = rng.randint(1, self.limit), rng.randint(1, self.limit)
            story = f"{who} has {a} {what} and gets {b} more. How many {what} does {who} have now?"
            answer = a + b
        elif operation == "-":
            a = rng.randint(2, self.limit)
            b = rng.randint(1, a - 1)
            story = (
                f"{who} has {a} {what} and gives away {b}. How many {what} does {who} have left?"
            )
            answer = a - b
        else:
            a, b = rng.randint(2, self.limit), rng.randint(2, self.limit)
            story = (
                f"{who} has {a} bags with {b} {what} in each bag. How many {what} does {who} have?"
            )
            answer = a * b
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        question = self.question.replace("{story}", story)
        messages = (*system, {"role": "user", "content": question})
        return Problem(prompt=story, answer=str(answer), messages=messages)

    def make_prompts(self, rng: random.Random, n: int) -> list[Problem]:
        return draw_training(self.draw, rng, n)

    def held_out(self, seed: int, n: int) -> list[Problem]:
        return draw_held_out(self.draw, seed, n)

    def reward(self, problem: Problem, completion: str, stop_reason: StopReason) -> float:
        """1.0 when the answer finished and its last number is the answer (reward `number`)."""
        return number(problem, completion, stop_reason, tolerance=0.0)

    def solution(self, problem: Problem) -> str:
        return problem.reference()
