"""The LLM judge against the stand-in judge server (recipes/judge_standin.py, a real HTTP server
on loopback that scores by difflib similarity to the reference answer): parsing, retries,
budgets, the cache, and failures that become bad rollouts."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from posttrain.models.tiny import build_tokenizer
from posttrain.rollouts.task_rollouts import sample_groups
from posttrain.tasks import DatasetTask, Judge, JudgeError, Problem, reward_step
from posttrain.tasks.judge_prompts import parse_group, parse_pointwise
from posttrain.tasks.rewards import RewardError, score_group
from posttrain.types import SamplingParams

sys.path.insert(0, str(Path(__file__).parents[2] / "recipes"))
from judge_standin import StandinJudge  # pyright: ignore[reportMissingImports]

sys.path.insert(0, str(Path(__file__).parents[1] / "rollouts"))
from test_task_rollouts import ScriptedSampler  # pyright: ignore[reportMissingImports]

PROMPT = "What is 2+3?"


def judge(server: StandinJudge, cache: Path | None = None, **options: object) -> Judge:
    return Judge(
        cache=cache, base_url=server.url, model="standin", rubric="match the answer", **options
    )


def test_pointwise_answers_parse_by_their_last_score_line():
    assert parse_pointwise("good.\nSCORE: 0.25") == 0.25
    assert parse_pointwise("score: 1\nthen, on reflection, Score: .5") == 0.5  # the last one
    for garbage in ("no score here", "SCORE: 1.5", "SCORE: -0.1", "SCORE: nan"):
        with pytest.raises(ValueError):
            parse_pointwise(garbage)


def test_group_answers_need_exactly_one_score_per_id():
    assert parse_group('sure: {"scores": [{"id": 2, "score": 0}, {"id": 1, "score": 1}]}', 2) == [
        1.0,
        0.0,
    ]
    bad = {
        "missing id 2": '{"scores": [{"id": 1, "score": 1}]}',
        "extra id 3": '{"scores": [{"id": 1, "score": 1}, {"id": 2, "score": 0}, {"id": 3, "score": 0}]}',
        "repeated id": '{"scores": [{"id": 1, "score": 1}, {"id": 1, "score": 0}]}',
        "not a number": '{"scores": [{"id": 1, "score": "high"}, {"id": 2, "score": 0}]}',
        "out of range": '{"scores": [{"id": 1, "score": 2}, {"id": 2, "score": 0}]}',
        "no scores list": '{"ranking": [1, 2]}',
        "no json": "1 is better than 2",
    }
    for why, text in bad.items():
        with pytest.raises(ValueError):
            parse_group(text, 2)
            pytest.fail(why)


async def test_scores_come_from_the_endpoint(standin: StandinJudge):
    j = judge(standin)
    # difflib ratio 2M/T: "5" vs "5" is 1; "55" vs "5" is 2*1/3; "x" vs "5" is 0.
    assert await j.score(PROMPT, "5", answer="5") == 1.0
    assert await j.score(PROMPT, "55", answer="5") == pytest.approx(2 / 3, abs=1e-6)  # 6 decimals
    group = await j.score_group(PROMPT, ["x", "55", "5"], answer="5")
    assert group == pytest.approx([0.0, 2 / 3, 1.0], abs=1e-6)
    assert standin.requests == 3 and j.stats.count("judge_calls") == 3


async def test_failed_requests_are_retried_then_fail_for_good(standin: StandinJudge):
    standin.fail_first = 2  # two HTTP 503s, then answers
    j = judge(standin, retries=2, backoff_s=0.01)
    assert await j.score(PROMPT, "5", answer="5") == 1.0
    assert standin.requests == 3 and j.stats.count("judge_calls") == 3

    standin.fail_first, standin.requests = 2, 0
    j = judge(standin, retries=1, backoff_s=0.01)
    with pytest.raises(JudgeError, match="failed after 2 attempts; last error: HTTP 503"):
        await j.score(PROMPT, "5", answer="5")
    assert standin.requests == 2 and j.stats.count("judge_failures") == 1
    assert issubclass(JudgeError, RewardError)  # the job's bad-rollout accounting sees it


async def test_a_step_spends_at_most_its_budget_of_calls(standin: StandinJudge):
    j = judge(standin, max_calls_per_step=2)
    with reward_step() as meter:
        assert await j.score(PROMPT, "5", answer="5") == 1.0
        assert await j.score(PROMPT, "x", answer="5") == 0.0
        with pytest.raises(JudgeError, match="max_calls_per_step = 2 spent"):
            await j.score(PROMPT, "55", answer="5")
        assert await j.score(PROMPT, "5", answer="5") == 1.0  # cached: no call needed
    counts = {k: v for k, v in meter.metrics().items() if k != "judge_s"}
    assert counts == {"judge_calls": 2, "judge_cache_hits": 1, "judge_failures": 1}
    with reward_step():  # the next step has its own budget
        assert await j.score(PROMPT, "55", answer="5") == pytest.approx(2 / 3, abs=1e-6)
    assert standin.requests == 3


async def test_a_step_spends_at_most_its_budget_of_seconds(standin: StandinJudge):
    standin.delay_s = 2.0
    j = judge(standin, max_seconds_per_step=0.3, retries=3)
    began = time.perf_counter()
    with reward_step(), pytest.raises(JudgeError, match=r"max_seconds_per_step = 0\.3 spent"):
        await j.score(PROMPT, "5", answer="5")
    # Given up at the budget (0.3 s), not after the server's 2 s, and not retried past it.
    assert time.perf_counter() - began < 1.5
    assert j.stats.count("judge_calls") == 1


async def test_a_resumed_judge_asks_nothing_it_asked_before(standin: StandinJudge, tmp_path: Path):
    completions = ["5", "55", "x", "5"]
    first = judge(standin, mode="group", cache=tmp_path / "cache.sqlite")
    scores = await first.score_group(PROMPT, completions, answer="5")
    pointwise = [await first.score(PROMPT, c, answer="5") for c in completions]
    assert standin.requests == 1 + 3  # one group; "5" twice pointwise is one request
    first.close()
    again = judge(standin, mode="group", cache=tmp_path / "cache.sqlite")
    with reward_step() as meter:
        assert await again.score_group(PROMPT, completions, answer="5") == scores
        assert [await again.score(PROMPT, c, answer="5") for c in completions] == pointwise
    assert standin.requests == 4  # no new request
    assert meter.count("judge_calls") == 0 and meter.count("judge_cache_hits") == 5
    # Another rubric is another judge: asked anew.
    other = Judge(
        base_url=standin.url, model="standin", rubric="other", cache=tmp_path / "cache.sqlite"
    )
    await other.score(PROMPT, "5", answer="5")
    assert standin.requests == 5


async def test_a_failed_group_judgement_is_each_of_its_rollouts_bad(
    standin: StandinJudge, tmp_path
):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(f'{{"prompt": "p{i}", "answer": "a"}}\n' for i in range(12)))
    # One request at a time, so the first group's is the first the server sees.
    j = judge(standin, mode="group", retries=0, max_concurrency=1)
    task = DatasetTask.from_jsonl(data, held_out_fraction=0.5, reward=j)
    assert task.group_reward is not None and task.reward_spec == "judge"
    standin.fail_first = 1  # the first group's request fails, the second's is answered
    sampler = ScriptedSampler(build_tokenizer(), [["a", "b"], ["a", "b"]])
    with reward_step():
        step = await sample_groups(
            sampler, task, task.train[:2], 2, SamplingParams(max_tokens=4), max_bad_rollouts=0.5
        )
    assert step.bad_rollouts == 2 and step.rollouts == 4  # the whole failed group
    assert [t.reward for g in step.groups for t in g.trajectories] == [1.0, 0.0]
    with reward_step(), pytest.raises(JudgeError, match="2 of 4 rollouts"):
        standin.fail_first, standin.requests = 1, 0
        j2 = judge(standin, mode="group", retries=0)
        await sample_groups(
            sampler,
            DatasetTask.from_jsonl(data, held_out_fraction=0.5, reward=j2),
            task.train[2:4],
            2,
            SamplingParams(max_tokens=4),
            max_bad_rollouts=0.25,
        )


async def test_group_rewards_are_checked_like_rewards():
    class Broken:
        name, reward_spec = "broken", "broken"

        async def group_reward(self, problem, completions, stop_reasons):
            return [1.0]  # one score for two completions

    results = await score_group(Broken(), Problem("p"), ["a", "b"], ["stop", "stop"])  # pyright: ignore[reportArgumentType]
    assert all(isinstance(r, RewardError) for r in results)
    assert "must be a list of 2 finite numbers" in str(results[0])


async def test_rescore_sets_rewards_of_gathered_groups(standin: StandinJudge):
    """ART-style: rollouts gathered by gather_groups, rewarded by the judge as each group
    completes (`after_each`), the prompt being the messages before the last assistant turn."""
    from posttrain import Trajectory, TrajectoryGroup, gather_groups
    from posttrain.data.trajectories import TokenSegment

    def rollout(answer: str) -> Trajectory:
        chat = [
            {"role": "user", "content": "Reference answer: abc"},
            {"role": "assistant", "content": answer},
        ]
        return Trajectory(segments=[TokenSegment((1, 2))], messages=chat, reward=0.0)

    j = judge(standin, mode="group")
    groups = [TrajectoryGroup([rollout("abc"), rollout("ab"), rollout("zzz")])]
    done = await gather_groups(groups, after_each=j.rescore, progress=False)
    # The stand-in finds the reference in the prompt: "abc" 1, "ab" 2*2/5, "zzz" 0; one request.
    assert [t.reward for t in done[0].trajectories] == pytest.approx([1.0, 0.8, 0.0], abs=1e-6)
    assert standin.requests == 1


def test_the_docs_show_the_stand_in_judge_of_recipes():
    """Each docs page's judge_standin.py block (own-task.md, data-to-model.md) is
    recipes/judge_standin.py, verbatim."""
    root = Path(__file__).parents[2]
    recipe = (root / "recipes" / "judge_standin.py").read_text()
    marker = "```python file=judge_standin.py\n"
    pages = [p for p in sorted((root / "docs").glob("*.md")) if marker in p.read_text()]
    assert {p.name for p in pages} == {"own-task.md", "data-to-model.md"}
    for page in pages:
        block = page.read_text().split(marker, 1)[1].split("```", 1)[0]
        assert block == recipe, page.name
