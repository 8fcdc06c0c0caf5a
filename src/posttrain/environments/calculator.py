"""A tool-use environment: arithmetic questions, a `calculator` tool, a reward for the answer.

The model is asked "What is 12 + 7 * 3?". It may call the tool, Qwen/Hermes style, as many
times as the episode's turn limit allows:

    <tool_call>{"name": "calculator", "arguments": {"expression": "12 + 7 * 3"}}</tool_call>

and each call is answered by a `tool` message: the value, or what was wrong with the call (not
closed, not JSON, an unknown tool, an expression that does not evaluate), so a malformed call
is something the model reads, never a crash. A message without a call is the final answer: the
number it ends with ("33", "It is 33.") is compared with the question's value, for a reward of
1 (right) or 0 (wrong, or no number at its end).
Calling the tool costs nothing: the turn limit bounds it, and a penalty would make a right
answer found with the tool score below 1, which counts as wrong in accuracy.

Questions come from `random.Random(seed)`; about one in ten is held out (the rule of the
built-in tasks, a hash of the question), and each split draws only its own.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import random
import re
from collections.abc import Callable, Sequence

from posttrain.environments.protocol import SPLITS, Reset, Split, Step
from posttrain.rollouts.tool_calls import (
    ToolCall,
    assistant_message,
    call_id,
    parse_tool_calls,
    tool_message,
)
from posttrain.tasks.protocol import Problem, is_held_out
from posttrain.tokenizer import ChatMessage

TOOL_NAME = "calculator"
SYSTEM_PROMPT = (
    'Use the calculator: <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}'
    "</tool_call>. Then answer with the number."
)
TOOL_SCHEMA: dict[str, object] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Evaluate an arithmetic expression: numbers, + - * / // % **, parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12 + 7 * 3"}},
            "required": ["expression"],
        },
    },
}
OPERATIONS = "+-*"
# The final answer: the number the message ends with ("33", "It is 33."); a message that goes
# on after its last number (a turn cut by max_tokens, mostly) has given none.
_ANSWER = re.compile(r"(?<![\d.])(-?\d+(?:\.\d+)?)\s*\.?\s*$")
_BINARY: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 1e15  # larger values are refused: no expression may make the tool hang
_DRAWS = 1000  # questions drawn per reset before concluding a split is empty


def evaluate_expression(expression: str) -> float:
    """The value of an arithmetic expression; ValueError saying what is wrong with it."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot read {expression!r} as arithmetic") from None
    return _value(tree.body)


def _value(node: ast.expr) -> float:
    constant = node.value if isinstance(node, ast.Constant) else None
    # bool is the one subclass of int or float that an ast.Constant holds
    if isinstance(constant, int | float) and not isinstance(constant, bool):
        return _bounded(constant)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > MAX_MAGNITUDE):
            raise ValueError("the power is too large")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise ValueError("the value is too large") from None
    raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")


def _bounded(value: float) -> float:
    if isinstance(value, complex) or not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise ValueError("the value is too large")
    return value


def format_number(value: float) -> str:
    """`7` for 7 and 7.0, `2.5` for 2.5."""
    if float(value).is_integer():
        return str(int(value))
    return format(value, ".12g")


class CalculatorEnv:
    """One arithmetic episode; `terms` numbers from 0 to `max_value` joined by `operations`."""

    def __init__(
        self,
        *,
        terms: int = 2,
        max_value: int = 99,
        operations: str = OPERATIONS,
        system_prompt: str | None = SYSTEM_PROMPT,
    ) -> None:
        if terms < 1 or max_value < 0:
            raise ValueError(f"need terms >= 1 and max_value >= 0, got {terms} and {max_value}")
        unknown = set(operations) - set("+-*/")
        if not operations or unknown:
            raise ValueError(f"operations must be some of '+-*/', got {operations!r}")
        self.terms, self.max_value, self.operations = terms, max_value, operations
        self.system_prompt = system_prompt
        self.question: str | None = None
        self.expression = ""
        self.answer = 0.0
        self._calls = 0
        self._messages: list[ChatMessage] = []

    def reset(self, seed: int, split: Split) -> Reset:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.question, self.expression, self.answer = self._question(random.Random(seed), split)
        self._calls = 0
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        self._messages = [*system, {"role": "user", "content": self.question}]
        return Reset(self._messages, tools=[TOOL_SCHEMA])

    def step(self, message: ChatMessage) -> Step:
        if self.question is None:
            raise ValueError("calculator: step() before reset()")
        content = message.get("content")
        text, calls = parse_tool_calls(content if isinstance(content, str) else "", self._calls)
        self._calls += len(calls)
        if calls:
            return Step(
                messages=[tool_message(call, self._run(call)) for call in calls],
                metrics={
                    "tool_calls": float(len(calls)),
                    "malformed_calls": float(sum(c.error is not None for c in calls)),
                    "answered": 0.0,
                },
                assistant=assistant_message(text, calls),
            )
        answer = _ANSWER.search(text)
        correct = answer is not None and math.isclose(
            float(answer.group(1)), self.answer, rel_tol=1e-9, abs_tol=1e-9
        )
        return Step(
            reward=1.0 if correct else 0.0,
            done=True,
            metrics={"tool_calls": 0.0, "malformed_calls": 0.0, "answered": float(bool(answer))},
        )

    def demonstration(self) -> Sequence[ChatMessage]:
        """The episode solved: one call with the question's expression, then the answer."""
        if self.question is None:
            raise ValueError("calculator: demonstration() before reset()")
        arguments = json.dumps({"name": TOOL_NAME, "arguments": {"expression": self.expression}})
        value = format_number(self.answer)
        return [
            *self._messages,
            {"role": "assistant", "content": f"<tool_call>{arguments}</tool_call>"},
            {"role": "tool", "tool_call_id": call_id(0), "name": TOOL_NAME, "content": value},
            {"role": "assistant", "content": value},
        ]

    def _run(self, call: ToolCall) -> str:
        if call.error is not None:
            return f"error: {call.error}"
        if call.name != TOOL_NAME:
            return f"error: unknown tool {call.name!r}; the tool is {TOOL_NAME!r}"
        expression = call.arguments.get("expression")
        if not isinstance(expression, str):
            return 'error: the calculator takes {"expression": "..."}'
        try:
            return format_number(evaluate_expression(expression))
        except ValueError as exc:
            return f"error: {exc}"

    def _question(self, rng: random.Random, split: Split) -> tuple[str, str, float]:
        """(question, expression, value) of the split's first question `rng` draws."""
        for _ in range(_DRAWS):
            expression = self._draw(rng)
            question = f"What is {expression}?"
            if is_held_out(Problem(question)) != (split == "held_out"):
                continue
            try:
                return question, expression, evaluate_expression(expression)
            except ValueError:  # a division by zero: draw another
                continue
        raise ValueError(
            f"calculator: no {split} question in {_DRAWS} draws; allow more questions "
            "(a larger max_value or more terms)"
        )

    def _draw(self, rng: random.Random) -> str:
        numbers = [str(rng.randint(0, self.max_value)) for _ in range(self.terms)]
        parts = [numbers[0]]
        for number in numbers[1:]:
            parts += [rng.choice(self.operations), number]
        return " ".join(parts)
