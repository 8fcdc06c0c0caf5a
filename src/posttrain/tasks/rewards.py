"""Rewards: the built-in ones a dataset task names, custom ones by dotted path, and `score`,
the checked call every reward goes through.

Each built-in reward compares a completion with its problem's answer and gives 1.0 for a right
answer, else 0.0; a completion cut by max_tokens (stop_reason "length") gets 0.0.

- `exact`: the completion equals the answer, surrounding whitespace aside.
- `contains`: the answer (surrounding whitespace aside) occurs in the completion.
- `number`: the last number in the completion is within `tolerance` (absolute) of the
  answer's number; thousands separators ("1,234") are allowed in both.
- `regex`: the last match of `pattern` in the completion (its first group, if the pattern
  has one) equals the answer, surrounding whitespace aside.
- `math`: math-verify finds the completion's answer mathematically equal to the answer
  (`\\boxed{1/2}` = `0.5`); needs `pip install 'posttrain[math]'`.

A custom reward is any function `(problem, completion, stop_reason) -> float`, or an
`async def` one, named by dotted path: `"mypkg.rewards:score"`.

Rewards from models: `judge` (an LLM judge, `posttrain.tasks.judge`) and `model:PATH` (a
reward model, `posttrain.tasks.reward_model`) are objects a job builds from its `[judge]` or
`[reward_model]` table; in Python, pass the object as a dataset task's reward. A task may also
score a problem's whole group of completions at once (`group_reward`, see `score_group`).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import re
import threading
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Protocol, cast

from posttrain.finder import Kind, load
from posttrain.tasks.protocol import Problem, Task
from posttrain.types import StopReason

RewardFn = Callable[[Problem, str, StopReason], float | Awaitable[float]]
# A reward of a problem's whole group of completions: one score per completion, in order.
GroupRewardFn = Callable[[Problem, Sequence[str], Sequence[StopReason]], Awaitable[list[float]]]
BUILTIN_REWARDS = ("exact", "contains", "number", "regex", "math")
JUDGE = "judge"  # [data] reward = "judge": the [judge] table's LLM judge
MODEL_PREFIX = "model:"  # [data] reward = "model:PATH": a local reward model
# make_reward builds the built-ins itself (some take a tolerance or a pattern).
REWARDS = Kind("reward", dict.fromkeys(BUILTIN_REWARDS), example="mypkg.rewards:score")
DEFAULT_TOLERANCE = 1e-6
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?(?:[eE][-+]?\d+)?|[-+]?\.\d+")


class RewardError(ValueError):
    """A reward that raised, or gave something other than a finite number."""


def exact(problem: Problem, completion: str, stop_reason: StopReason) -> float:
    """1.0 when the completion is the answer, surrounding whitespace aside."""
    if stop_reason == "length":
        return 0.0
    return float(completion.strip() == problem.reference().strip())


def contains(problem: Problem, completion: str, stop_reason: StopReason) -> float:
    """1.0 when the answer occurs in the completion."""
    if stop_reason == "length":
        return 0.0
    return float(problem.reference().strip() in completion)


def parse_number(text: str) -> float | None:
    """The last number in `text` ("1,234.5" counts as 1234.5), or None."""
    found = _NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def number_value(answer: str) -> float:
    """An answer's number: the whole answer must be one number."""
    stripped = answer.strip()
    match = _NUMBER.fullmatch(stripped)
    if match is None:
        raise ValueError(f"answer {answer!r} is not a number (reward 'number' compares numbers)")
    return float(stripped.replace(",", ""))


def number(
    problem: Problem, completion: str, stop_reason: StopReason, *, tolerance: float
) -> float:
    """1.0 when the completion's last number is within `tolerance` of the answer's."""
    if stop_reason == "length":
        return 0.0
    value = parse_number(completion)
    target = number_value(problem.reference())
    return float(value is not None and abs(value - target) <= tolerance)


def regex(
    problem: Problem, completion: str, stop_reason: StopReason, *, pattern: re.Pattern[str]
) -> float:
    """1.0 when the last match of `pattern` (its first group, if any) is the answer."""
    if stop_reason == "length":
        return 0.0
    matches = list(pattern.finditer(completion))
    if not matches:
        return 0.0
    last = matches[-1]
    extracted = last.group(1) if pattern.groups else last.group(0)
    return float((extracted or "").strip() == problem.reference().strip())


def math_equal(problem: Problem, completion: str, stop_reason: StopReason) -> float:
    """1.0 when math-verify finds the completion's answer equal to the reference."""
    if stop_reason == "length":
        return 0.0
    parse, verify = _math_verify()
    # math-verify's timeouts use SIGALRM, which only the main thread may set.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(problem.reference(), parsing_timeout=timeout)
    answer = parse(completion, parsing_timeout=timeout)
    return float(verify(gold, answer, timeout_seconds=timeout))


def _math_verify() -> tuple[Callable[..., object], Callable[..., bool]]:
    try:
        from math_verify import parse, verify
    except ImportError as exc:
        raise ImportError("reward 'math' needs math-verify: pip install 'posttrain[math]'") from exc
    return parse, verify


def make_reward(
    spec: str,
    *,
    tolerance: float | None = None,
    pattern: str | None = None,
    search: Path | None = None,
) -> RewardFn:
    """The reward named `spec`: a built-in name or a dotted path "pkg.module:function"
    (imported from `sys.path`, then the directory `search`).

    `tolerance` is for `number` only (default 1e-6), `pattern` for `regex` only (required).
    """
    if tolerance is not None and spec != "number":
        raise ValueError(f"tolerance is for reward 'number' only, not {spec!r}")
    if pattern is not None and spec != "regex":
        raise ValueError(f"pattern is for reward 'regex' only, not {spec!r}")
    if spec == JUDGE or spec.startswith(MODEL_PREFIX):
        raise ValueError(
            f"reward {spec!r} is a model: a job builds it from its [judge] or [reward_model] "
            "table; in Python pass the object, reward=Judge(...) or reward=RewardModel(path)"
        )
    if spec == "exact":
        return exact
    if spec == "contains":
        return contains
    if spec == "number":
        tolerance = DEFAULT_TOLERANCE if tolerance is None else tolerance
        if not tolerance >= 0:
            raise ValueError(f"tolerance must be >= 0, got {tolerance}")
        return partial(number, tolerance=tolerance)
    if spec == "regex":
        return partial(regex, pattern=compile_pattern(pattern))
    if spec == "math":
        _math_verify()  # a missing extra is an error now, not at the first reward
        return math_equal
    function = load(spec, REWARDS, search=search)  # a built-in returned above
    if not callable(function):
        raise ValueError(f"reward {spec!r} is a {type(function).__name__}, not a function")
    return function  # pyright: ignore[reportReturnType]


def compile_pattern(pattern: str | None) -> re.Pattern[str]:
    """`pattern` compiled; reward 'regex' needs one, with at most one group."""
    if not pattern:
        raise ValueError("reward 'regex' needs a pattern, e.g. pattern = 'answer: (\\\\S+)'")
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"pattern {pattern!r} is not a valid regular expression: {exc}") from None


def reward_label(task: Task) -> str:
    """How errors name a task's reward: a dataset task's reward spec, else Class.reward."""
    label = getattr(task, "reward_spec", None)
    return repr(label) if isinstance(label, str) else f"{type(task).__name__}.reward"


async def score(task: Task, problem: Problem, completion: str, stop_reason: StopReason) -> float:
    """`task.reward(...)`, awaited if it is a coroutine, checked to be a finite number.

    Anything else (an exception, NaN, a string, None) is a RewardError naming the reward and
    the problem (its file and line, for a dataset's).
    """
    try:
        value: object = task.reward(problem, completion, stop_reason)
        if inspect.isawaitable(value):
            value = await value
    except Exception as exc:  # user code may fail in any way: say whose code and where
        raise RewardError(
            f"reward {reward_label(task)} raised {type(exc).__name__}: {exc} (on "
            f"{problem.where()}, completion {completion[:80]!r})"
        ) from exc
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value)
    what = "NaN" if isinstance(value, numbers.Real) and math.isnan(float(value)) else repr(value)
    raise RewardError(
        f"reward {reward_label(task)} returned {what} for {problem.where()}: a reward must be a "
        "finite number (a float)"
    )


class RewardSource(Protocol):
    """A reward object (`Judge`, `RewardModel`): its name, a per-completion reward, and a group
    reward or None."""

    @property
    def spec(self) -> str: ...

    def reward(
        self, problem: Problem, completion: str, stop_reason: StopReason
    ) -> Awaitable[float]: ...

    @property
    def group_reward(self) -> GroupRewardFn | None: ...


def group_reward_of(task: Task) -> GroupRewardFn | None:
    """The task's optional `group_reward(problem, completions, stop_reasons)`, or None."""
    found = getattr(task, "group_reward", None)
    return cast(GroupRewardFn, found) if callable(found) else None


async def score_group(
    task: Task, problem: Problem, completions: Sequence[str], stop_reasons: Sequence[StopReason]
) -> list[float | BaseException]:
    """Each completion's reward, or the error that stands for it: one `task.group_reward` call
    when the task has one (a failure of it is every completion's RewardError), else `score`
    per completion (each failing alone)."""
    group = group_reward_of(task)
    if group is None:
        return list(
            await asyncio.gather(
                *(
                    score(task, problem, c, s)
                    for c, s in zip(completions, stop_reasons, strict=True)
                ),
                return_exceptions=True,
            )
        )
    try:
        values: object = await group(problem, list(completions), list(stop_reasons))
    except RewardError as exc:
        return [exc] * len(completions)
    except Exception as exc:  # user code may fail in any way: say whose code and where
        error = RewardError(
            f"group reward {reward_label(task)} raised {type(exc).__name__}: {exc} (on "
            f"{problem.where()})"
        )
        error.__cause__ = exc
        return [error] * len(completions)
    if not isinstance(values, list | tuple) or len(values) != len(completions):
        error = RewardError(
            f"group reward {reward_label(task)} returned {values!r} for {problem.where()}: it "
            f"must be a list of {len(completions)} finite numbers, one per completion"
        )
        return [error] * len(completions)
    out: list[float | BaseException] = []
    for value in values:
        if isinstance(value, numbers.Real) and math.isfinite(float(value)):
            out.append(float(value))
        else:
            out.append(
                RewardError(
                    f"group reward {reward_label(task)} returned {value!r} for a completion of "
                    f"{problem.where()}: a reward must be a finite number (a float)"
                )
            )
    return out
