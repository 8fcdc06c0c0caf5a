"""Built-in tasks: problem format, hand-checked rewards, and a held-out split disjoint from training."""

from __future__ import annotations

import random

import pytest

from posttrain.tasks import (
    TASKS,
    AdditionTask,
    Problem,
    ReverseTask,
    WordProblemsTask,
    get_task,
    is_held_out,
)
from posttrain.tasks.protocol import HELD_OUT_MODULUS


def test_registry_names_match():
    assert set(TASKS) == {"reverse", "addition", "word-problems"}
    for name, task in TASKS.items():
        assert task.name == name


def test_get_task_suggests_the_nearest_name():
    with pytest.raises(ValueError, match="unknown task 'revers'; did you mean 'reverse'"):
        get_task("revers")


def test_reverse_problems():
    problems = ReverseTask().make_prompts(random.Random(0), 300)
    assert len(problems) == 300
    for p in problems:
        verb, word = p.prompt.split(" ")
        assert verb == "reverse"
        assert 3 <= len(word) <= 6 and word.isalpha() and word.islower()
        assert p.answer == word[::-1]
    assert {len(p.reference()) for p in problems} == {3, 4, 5, 6}


def test_addition_problems():
    for p in AdditionTask().make_prompts(random.Random(0), 300):
        a, b = p.prompt.removesuffix("=").split("+")
        assert 0 <= int(a) < 100 and 0 <= int(b) < 100
        assert p.answer == str(int(a) + int(b))


@pytest.mark.parametrize(
    ("completion", "stop_reason", "expected"),
    [
        ("dcba", "stop", 1.0),  # exact answer then EOS
        ("dcba", "length", 0.0),  # right letters but cut by max_tokens: no EOS
        ("dcb", "stop", 0.0),  # too short
        ("dcbaa", "stop", 0.0),  # too long
        ("dcba ", "stop", 0.0),  # trailing space
        ("abcd", "stop", 0.0),  # copied, not reversed
        ("dcba<|im_start|>", "stop", 0.0),  # a special token is kept as text, so never matches
        ("", "stop", 0.0),
    ],
)
def test_reverse_reward_hand_cases(completion, stop_reason, expected):
    problem = Problem(prompt="reverse abcd", answer="dcba")
    assert ReverseTask().reward(problem, completion, stop_reason) == expected


@pytest.mark.parametrize(
    ("completion", "stop_reason", "expected"),
    [
        ("81", "stop", 1.0),  # 23 + 58 = 81
        ("081", "stop", 0.0),  # the canonical decimal only
        ("81", "length", 0.0),
        ("18", "stop", 0.0),
        ("8", "stop", 0.0),
    ],
)
def test_addition_reward_hand_cases(completion, stop_reason, expected):
    problem = Problem(prompt="23+58=", answer="81")
    assert AdditionTask().reward(problem, completion, stop_reason) == expected


def _words(story: str) -> list[str]:
    return story.replace(".", " ").replace("?", " ").split()


def _story_answer(story: str) -> int:
    """The answer read back from a story's words (a second derivation of it)."""
    words = _words(story)
    a, b = (int(w) for w in words if w.isdigit())
    if "more" in words:
        return a + b
    if "away" in words:
        return a - b
    assert "bags" in words
    return a * b


def test_word_problems():
    task = WordProblemsTask(operations="+-*", limit=5)
    problems = task.make_prompts(random.Random(0), 600)
    for p in problems:
        system, user = p.chat()
        assert system == {"role": "system", "content": "Answer with the number only."}
        assert user == {"role": "user", "content": p.prompt}
        assert p.answer == str(_story_answer(p.prompt))
        numbers = [int(w) for w in _words(p.prompt) if w.isdigit()]
        assert all(1 <= n <= 5 for n in numbers) and int(p.reference()) >= 1
    kinds = {w for p in problems for w in _words(p.prompt) if w in ("more", "away", "bags")}
    assert kinds == {"more", "away", "bags"}
    # The default: + and - only, and no system prompt when it is "".
    assert all(
        "bags" not in p.prompt for p in TASKS["word-problems"].make_prompts(random.Random(1), 300)
    )
    assert WordProblemsTask(system_prompt="").draw(random.Random(0)).chat()[0]["role"] == "user"


def test_word_problems_question_frames_the_story_and_keeps_the_split():
    plain = WordProblemsTask(system_prompt="", question="Question: {story}\nAnswer:")
    default = WordProblemsTask(system_prompt="")
    (framed,) = plain.held_out(0, 1)
    (bare,) = default.held_out(0, 1)
    assert framed.prompt == bare.prompt  # the story: the split and the logs see the same
    assert framed.chat() == [{"role": "user", "content": f"Question: {bare.prompt}\nAnswer:"}]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"operations": "+/"}, "operations must be some of '\\+-\\*', got '\\+/'"),
        ({"operations": ""}, "operations must be some of"),
        ({"limit": 1}, "limit must be >= 2, got 1"),
        ({"question": "Q: {text}"}, "question must contain {story}"),
    ],
)
def test_word_problems_options_are_checked(options, message):
    with pytest.raises(ValueError, match=message):
        WordProblemsTask(**options)


@pytest.mark.parametrize(
    ("completion", "stop_reason", "expected"),
    [
        ("12", "stop", 1.0),  # 7 + 5 = 12
        ("Mia has 7 + 5 = 12 shells.", "stop", 1.0),  # the last number counts
        ("12 shells, or 13", "stop", 0.0),  # ... only the last
        ("12", "length", 0.0),  # cut by max_tokens: it did not finish
        ("twelve", "stop", 0.0),  # no number
        ("1,2", "stop", 0.0),  # not a thousands separator: two numbers, the last is 2
        ("", "stop", 0.0),
    ],
)
def test_word_problems_reward_hand_cases(completion, stop_reason, expected):
    problem = Problem(prompt="Mia has 7 shells and gets 5 more. ...", answer="12")
    assert WordProblemsTask().reward(problem, completion, stop_reason) == expected


@pytest.mark.parametrize("name", sorted(TASKS))
def test_solution_earns_full_reward(name):
    task = TASKS[name]
    for p in task.make_prompts(random.Random(1), 50):
        assert task.reward(p, task.solution(p), "stop") == 1.0


@pytest.mark.parametrize("name", sorted(TASKS))
def test_held_out_is_disjoint_from_training(name):
    task = TASKS[name]
    held = task.held_out(0, 200)
    assert len(held) == 200
    assert len({p.prompt for p in held}) == 200  # distinct
    assert all(is_held_out(p) for p in held)
    training = {p.prompt for seed in range(5) for p in task.make_prompts(random.Random(seed), 2000)}
    assert not training & {p.prompt for p in held}
    assert not any(is_held_out(Problem(prompt, "")) for prompt in training)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_held_out_depends_on_its_seed_only(name):
    task = TASKS[name]
    assert task.held_out(3, 50) == task.held_out(3, 50)
    assert task.held_out(3, 50) != task.held_out(4, 50)
    assert task.held_out(3, 20) == task.held_out(3, 50)[:20]  # a prefix: sizes nest


def test_split_holds_out_about_one_problem_in_ten():
    every = [Problem(f"{a}+{b}=", str(a + b)) for a in range(100) for b in range(100)]
    held = sum(is_held_out(p) for p in every)
    # A uniform hash puts 10,000 / HELD_OUT_MODULUS = 1,000 here, with std ~30.
    assert abs(held - 10_000 / HELD_OUT_MODULUS) < 150


def test_too_many_held_out_problems_is_an_error():
    # 3 x 3 = 9 problems in all; at most a few fall in the held-out split.
    with pytest.raises(
        ValueError, match="n=50 is more held-out problems than this task can supply"
    ):
        AdditionTask(limit=3).held_out(0, 50)


def test_bad_task_settings():
    with pytest.raises(ValueError, match="min_length <= max_length"):
        ReverseTask(min_length=5, max_length=3)
    with pytest.raises(ValueError, match="limit must be >= 2"):
        AdditionTask(limit=1)
    with pytest.raises(ValueError, match="n must be >= 0"):
        ReverseTask().make_prompts(random.Random(0), -1)
