"""Built-in rewards on hand-checked cases, custom rewards by dotted path (sync and async), and
`score`'s errors for a reward that raises or returns NaN or a non-number."""

from __future__ import annotations

import math
import sys
from functools import partial

import pytest

from posttrain.tasks import Problem
from posttrain.tasks.dataset import DatasetTask
from posttrain.tasks.rewards import (
    RewardError,
    contains,
    exact,
    make_reward,
    math_equal,
    number,
    parse_number,
    regex,
    score,
)


def _p(answer: str | None) -> Problem:
    return Problem("q", answer, source="data.jsonl:7")


@pytest.mark.parametrize(
    ("completion", "stop_reason", "expected"),
    [
        ("42", "stop", 1.0),
        ("  42\n", "stop", 1.0),  # surrounding whitespace aside
        ("42", "length", 0.0),  # cut by max_tokens: never right
        ("042", "stop", 0.0),
        ("the answer is 42", "stop", 0.0),
    ],
)
def test_exact(completion, stop_reason, expected):
    assert exact(_p(" 42 "), completion, stop_reason) == expected


@pytest.mark.parametrize(
    ("completion", "stop_reason", "expected"),
    [
        ("the answer is Paris.", "stop", 1.0),
        ("Paris", "stop", 1.0),
        ("paris", "stop", 0.0),  # case matters
        ("the answer is Paris.", "length", 0.0),
    ],
)
def test_contains(completion, stop_reason, expected):
    assert contains(_p("Paris"), completion, stop_reason) == expected


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("so 3 + 4 = 7", 7.0),  # the last number
        ("-2.5", -2.5),
        ("1,234 apples", 1234.0),  # a thousands separator
        ("1e3", 1000.0),
        (".5", 0.5),
        ("no number", None),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize(
    ("completion", "tolerance", "expected"),
    [
        ("x = 3.14", 0.01, 1.0),  # |3.14 - 3.14159| = 0.0016 <= 0.01
        ("x = 3.14", 1e-3, 0.0),  # 0.0016 > 0.001
        ("x = 3.1416", 1e-3, 1.0),  # 0.00001 <= 0.001
        ("first 3.14159 then 2", 0.01, 0.0),  # the last number counts
        ("none", 0.01, 0.0),
    ],
)
def test_number(completion, tolerance, expected):
    assert number(_p("3.14159"), completion, "stop", tolerance=tolerance) == expected


def test_number_default_tolerance_and_answer_check():
    reward = make_reward("number")
    assert reward(_p("1,000"), "1000", "stop") == 1.0
    assert reward(_p("12"), "12.0000001", "stop") == 1.0  # 1e-7 <= the default 1e-6
    assert reward(_p("12"), "12.00001", "stop") == 0.0  # 1e-5 > 1e-6
    with pytest.raises(ValueError, match="answer 'twelve' is not a number"):
        reward(_p("twelve"), "12", "stop")


@pytest.mark.parametrize(
    ("pattern", "completion", "expected"),
    [
        (r"#### (\S+)", "think... #### 72", 1.0),  # the first group
        (r"#### (\S+)", "#### 71 no, #### 72", 1.0),  # the last match
        (r"#### (\S+)", "#### 72 no, #### 71", 0.0),
        (r"\d+", "about 72", 1.0),  # no group: the whole match
        (r"#### (\S+)", "72", 0.0),  # no match
    ],
)
def test_regex(pattern, completion, expected):
    reward = make_reward("regex", pattern=pattern)
    assert reward(_p("72"), completion, "stop") == expected
    assert regex(_p("72"), completion, "length", pattern=__import__("re").compile(pattern)) == 0.0


def test_math():
    assert math_equal(_p("\\frac{1}{2}"), "so $\\boxed{0.5}$", "stop") == 1.0
    assert math_equal(_p("1/2"), "$\\frac12$", "stop") == 1.0
    assert math_equal(_p("$x^2+1$"), "$1+x^2$", "stop") == 1.0
    assert math_equal(_p("3"), "x = 4", "stop") == 0.0
    assert math_equal(_p("3"), "3", "length") == 0.0


def test_math_without_the_extra_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r"pip install 'posttrain\[math\]'"):
        make_reward("math")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"spec": "exactly"},
            r"unknown reward 'exactly'; did you mean 'exact'\? \(known rewards: exact, contains",
        ),
        ({"spec": "exact", "tolerance": 0.1}, r"tolerance is for reward 'number' only"),
        ({"spec": "number", "pattern": "x"}, r"pattern is for reward 'regex' only"),
        ({"spec": "regex"}, r"reward 'regex' needs a pattern"),
        ({"spec": "regex", "pattern": "(x"}, r"pattern '\(x' is not a valid regular expression"),
        ({"spec": "number", "tolerance": -1.0}, r"tolerance must be >= 0"),
        ({"spec": "no_such_module_x:f"}, r"module 'no_such_module_x' does not import"),
        (
            {"spec": "posttrain.tasks.rewards:exactt"},
            r"has no attribute 'exactt'; did you mean 'exact'",
        ),
        ({"spec": "posttrain.tasks.rewards:BUILTIN_REWARDS"}, r"is a tuple, not a function"),
    ],
)
def test_make_reward_errors(kwargs, message):
    spec = kwargs.pop("spec")
    with pytest.raises(ValueError, match=message):
        make_reward(spec, **kwargs)


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "import asyncio\n"
        "def length(problem, completion, stop_reason):\n"
        "    return len(completion) / 10\n"
        "async def judged(problem, completion, stop_reason):\n"
        "    await asyncio.sleep(0)\n"
        "    return 1.0 if completion == problem.info['gold'] else 0.25\n"
        "def broken(problem, completion, stop_reason):\n"
        "    return 1 / 0\n"
        "def nan(problem, completion, stop_reason):\n"
        "    return float('nan')\n"
        "async def text(problem, completion, stop_reason):\n"
        "    return 'good'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "gold": "x"}\n{"prompt": "b", "gold": "y"}\n')
    (tmp_path / "h.jsonl").write_text('{"prompt": "c", "gold": "z"}\n')
    return data


def _task(data, reward: str) -> DatasetTask:
    return DatasetTask.from_jsonl(data, data.with_name("h.jsonl"), reward=reward)


async def test_custom_rewards_sync_and_async(reward_module):
    # A custom reward needs no answer field: it reads the line's other fields from `info`.
    sync = _task(reward_module, "my_rewards:length")
    assert sync.train[0].answer is None
    assert await score(sync, sync.train[0], "abcd", "stop") == 0.4
    judged = _task(reward_module, "my_rewards:judged")
    assert await score(judged, judged.train[0], "x", "stop") == 1.0
    assert await score(judged, judged.train[0], "y", "stop") == 0.25


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        (
            "my_rewards:broken",
            r"reward 'my_rewards:broken' raised ZeroDivisionError: division by zero \(on the "
            r"problem at .*d\.jsonl:2, completion 'z'\)",
        ),
        (
            "my_rewards:nan",
            r"reward 'my_rewards:nan' returned NaN for the problem at .*d\.jsonl:2: a reward "
            r"must be a finite number",
        ),
        (
            "my_rewards:text",
            r"reward 'my_rewards:text' returned 'good' for the problem at .*d\.jsonl:2",
        ),
    ],
)
async def test_a_bad_reward_names_itself_the_file_and_the_line(reward_module, reward, message):
    task = _task(reward_module, reward)
    with pytest.raises(RewardError, match=message):
        await score(task, task.train[1], "z", "stop")


async def test_score_accepts_numbers_and_rejects_infinity():
    task = DatasetTask(
        name="t", train=(_p("1"),), held_out_problems=(_p("1"),),
        reward_fn=lambda p, c, s: math.inf, reward_spec="inf",
    )  # fmt: skip
    with pytest.raises(RewardError, match=r"returned inf for the problem at data\.jsonl:7"):
        await score(task, _p("1"), "x", "stop")
    integer = DatasetTask(**{**task.__dict__, "reward_fn": lambda p, c, s: 1})
    assert await score(integer, _p("1"), "x", "stop") == 1.0
    assert isinstance(partial(number, tolerance=0.0)(_p("1"), "1", "stop"), float)
