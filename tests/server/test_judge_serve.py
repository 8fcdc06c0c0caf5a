"""A tiny judge served by `posttrain serve` (random weights: it answers garbage). Each
unparsable answer is retried, then a JudgeError, the job's bad rollout; a step's budget of
calls holds; a failure is not cached, so a later step asks again."""

from __future__ import annotations

from pathlib import Path

import pytest
from serve_helpers import KEY, ServerProcess

from posttrain.rollouts.task_rollouts import check_bad_rollouts
from posttrain.tasks import Judge, JudgeError, Problem, reward_step

# Talks to the shared `posttrain serve` subprocess.
pytestmark = pytest.mark.slow


async def test_garbage_answers_are_retried_then_bad_rollouts(
    server: ServerProcess, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("JUDGE_KEY", KEY)
    judge = Judge(
        base_url=f"{server.url}/v1",
        model=str(tiny_model_dir),
        rubric="the answer is right",
        api_key_env="JUDGE_KEY",
        max_tokens=8,
        retries=2,
        backoff_s=0.01,
        max_calls_per_step=4,
    )
    problem = Problem("What is 2+3?", answer="5", source="sums.jsonl:1")
    with reward_step() as meter:
        with pytest.raises(JudgeError, match=r"failed after 3 attempts; last error: no 'SCORE"):
            await judge.reward(problem, "5", "stop")
        # One request and two retries spent 3 of the step's 4 calls: the next gets one try.
        with pytest.raises(JudgeError, match=r"sums\.jsonl:1") as second:
            await judge.reward(problem, "6", "stop")
    assert "max_calls_per_step = 4 spent" in str(second.value)
    assert meter.count("judge_calls") == 4 and meter.count("judge_failures") == 2
    # The job's accounting: two failed rollouts of four, within max_bad_rollouts = 0.5.
    check_bad_rollouts([second.value, second.value], 4, 0.5)
    with pytest.raises(JudgeError, match="2 of 4 rollouts"):
        check_bad_rollouts([second.value, second.value], 4, 0.25)
    # Not cached: a failure is asked again in the next step.
    with reward_step() as meter, pytest.raises(JudgeError):
        await judge.reward(problem, "5", "stop")
    assert meter.count("judge_calls") == 3 and meter.count("judge_cache_hits") == 0


async def test_a_wrong_key_is_not_retried(server: ServerProcess, tiny_model_dir: Path):
    judge = Judge(base_url=f"{server.url}/v1", model=str(tiny_model_dir), rubric="r")
    with pytest.raises(JudgeError, match="HTTP 401"):
        await judge.score("2+3?", "5")
    assert judge.stats.count("judge_calls") == 1
