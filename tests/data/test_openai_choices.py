"""ART's trajectory shapes and the OpenAI choice -> exact-token conversion, without a server.

Choices here are plain dicts in the JSON shape posttrain's endpoints answer with (the `openai`
SDK's objects are exercised against real endpoints in tests/backends/test_openai_rollouts_*).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest

import posttrain as art
from posttrain.data.openai_choices import (
    SampledTurn,
    attach_prompt_token_ids,
    sampled_turn,
    segments_from_turns,
)
from posttrain.data.trajectories import TokenSegment
from posttrain.rollouts.gather import gather_groups
from posttrain.rollouts.tool_calls import openai_tool_calls


def chat_choice(prompt: list[int], tokens: list[int], content: str = "hi") -> dict[str, object]:
    return {
        "index": 0,
        "message": {"role": "assistant", "content": content},
        "finish_reason": "stop",
        "logprobs": {"content": [{"token": "x", "logprob": -0.5 - i} for i in range(len(tokens))]},
        "prompt_token_ids": prompt,
        "token_ids": tokens,
    }


def test_two_turns_become_context_trainable_context_trainable():
    first = chat_choice([1, 2, 3], [4, 5], "ab")
    # The second prompt repeats turn 1's prompt and sampled tokens, then a tool result.
    second = chat_choice([1, 2, 3, 4, 5, 9, 9, 6], [7, 8], "cd")
    trajectory = art.Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "q"},
            first,
            {"role": "tool", "content": "r"},
            second,
        ],
        reward=0.5,
    )
    assert trajectory.segments == (
        TokenSegment((1, 2, 3)),
        TokenSegment((4, 5), True, (-0.5, -1.5)),
        TokenSegment((9, 9, 6)),
        TokenSegment((7, 8), True, (-0.5, -1.5)),
    )
    assert trajectory.tokens == [1, 2, 3, 4, 5, 9, 9, 6, 7, 8]
    assert trajectory.num_trainable_tokens == 4
    assert trajectory.messages() == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "ab"},
        {"role": "tool", "content": "r"},
        {"role": "assistant", "content": "cd"},
    ]


def test_a_later_prompt_that_rewrites_history_is_refused_naming_the_turn():
    first = chat_choice([1, 2, 3], [4, 5])
    rewritten = chat_choice([1, 2, 3, 4, 6, 9], [7])  # the template re-rendered token 5 as 6
    trajectory = art.Trajectory(
        messages_and_choices=[first, {"role": "user", "content": "x"}, rewritten]
    )
    with pytest.raises(ValueError, match=r"messages_and_choices\[2\] \(turn 2\).*position 4"):
        trajectory.segments  # noqa: B018
    with pytest.raises(ValueError, match="include_stop_str_in_output"):
        trajectory.tokens  # noqa: B018


def test_missing_token_ids_or_logprobs_name_the_field_and_the_server():
    no_ids = chat_choice([1], [2])
    del no_ids["token_ids"]
    with pytest.raises(ValueError, match=r"messages_and_choices\[0\]\.token_ids is missing.*vLLM"):
        art.Trajectory(messages_and_choices=[no_ids]).segments  # noqa: B018
    no_logprobs = chat_choice([1], [2])
    no_logprobs["logprobs"] = None
    with pytest.raises(ValueError, match=r"\.logprobs is missing.*logprobs=True"):
        sampled_turn(no_logprobs)
    short = chat_choice([1], [2, 3])
    short["logprobs"] = {"content": [{"logprob": -1.0}]}
    with pytest.raises(ValueError, match="1 entries for 2 sampled tokens"):
        sampled_turn(short)
    with pytest.raises(ValueError, match="no choice"):
        art.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}]).segments  # noqa: B018


def test_text_completion_choice_and_vllm_chat_response_shape():
    completion = {
        "index": 0,
        "text": "yo",
        "finish_reason": "length",
        "logprobs": {"token_logprobs": [-0.25, -0.75], "tokens": ["y", "o"]},
        "prompt_token_ids": [3, 4],
        "token_ids": [5, 6],
    }
    assert sampled_turn(completion) == SampledTurn((3, 4), (5, 6), (-0.25, -0.75))
    # vLLM puts a chat response's prompt ids on the response only.
    choice = chat_choice([], [2])
    del choice["prompt_token_ids"]
    response = {"prompt_token_ids": [1], "choices": [choice]}
    with pytest.raises(ValueError, match="prompt_token_ids is missing"):
        sampled_turn(choice)
    attach_prompt_token_ids(response)
    assert sampled_turn(choice).prompt_tokens == (1,)


def test_segments_from_turns_is_the_public_conversion():
    turns = [SampledTurn((1,), (2,), (-1.0,)), SampledTurn((1, 2, 3), (4,), (-2.0,))]
    assert segments_from_turns(turns) == (
        TokenSegment((1,)),
        TokenSegment((2,), True, (-1.0,)),
        TokenSegment((3,)),
        TokenSegment((4,), True, (-2.0,)),
    )
    with pytest.raises(ValueError, match="one logprob per sampled token"):
        SampledTurn((1,), (2, 3), (-1.0,))


def test_trajectory_reward_is_checked_on_every_assignment():
    trajectory = art.Trajectory(messages_and_choices=[chat_choice([1], [2])])
    assert trajectory.reward == 0.0  # ART's default
    trajectory.reward = 1  # an int is a number
    assert trajectory.reward == 1.0 and isinstance(trajectory.reward, float)
    for bad in (math.nan, math.inf, "1.0", None, True):
        with pytest.raises(ValueError, match="reward must be a finite number"):
            trajectory.reward = bad  # pyright: ignore[reportAttributeAccessIssue]
    assert trajectory.reward == 1.0
    with pytest.raises(ValueError, match="needs its tokens"):
        art.Trajectory(reward=1.0)


def test_segments_form_and_dataclasses_replace_still_work():
    seg = TokenSegment((1, 2), trainable=True, logprobs=(-0.1, -0.2))
    old = art.Trajectory(
        (TokenSegment((7,)), seg), 1.0, messages=({"role": "user", "content": "x"},)
    )
    assert old.messages == ({"role": "user", "content": "x"},) and old.messages() == [
        {"role": "user", "content": "x"}
    ]
    new = dataclasses.replace(old, segments=(seg,))
    assert new.segments == (seg,) and new.reward == 1.0 and new.messages == old.messages
    art_form = art.Trajectory(messages_and_choices=[chat_choice([1], [2])], reward=0.5)
    copied = dataclasses.replace(art_form, reward=0.25)
    assert copied.tokens == [1, 2] and copied.reward == 0.25 and art_form.reward == 0.5


def test_appending_choices_after_construction_updates_the_tokens():
    trajectory = art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}])
    trajectory.messages_and_choices.append(chat_choice([1], [2]))  # pyright: ignore[reportOptionalMemberAccess]
    assert trajectory.tokens == [1, 2]
    trajectory.messages_and_choices.append(chat_choice([1, 2, 3], [4]))  # pyright: ignore[reportOptionalMemberAccess]
    assert trajectory.tokens == [1, 2, 3, 4]


def rollout(reward: float, *, fail: bool = False, delay: float = 0.0):
    async def run() -> art.Trajectory:
        await asyncio.sleep(delay)
        if fail:
            raise RuntimeError(f"rollout {reward} failed")
        return art.Trajectory(messages_and_choices=[chat_choice([1], [2])], reward=reward)

    return run()


async def test_a_group_of_awaitables_runs_when_awaited():
    group = art.TrajectoryGroup(rollout(r, delay=0.01 * (3 - r)) for r in range(3))
    assert len(group) == 3 and group.num_pending == 3
    with pytest.raises(ValueError, match="not yet run"):
        group.trajectories  # noqa: B018
    done = await group
    assert sorted(done.rewards) == [0.0, 1.0, 2.0] and done.num_pending == 0
    with pytest.raises(RuntimeError, match="rollout 1 failed"):
        await art.TrajectoryGroup([rollout(0), rollout(1, fail=True)])


async def test_gather_counts_bad_rollouts_and_drops_them_within_the_bound():
    def groups():
        return [
            art.TrajectoryGroup([rollout(1.0), rollout(2.0, fail=True), rollout(3.0)]),
            art.TrajectoryGroup([rollout(4.0), rollout(5.0)]),
        ]

    # 1 bad of 5: an int bound of 1, or a fraction of 0.2, tolerates it.
    for bound in (1, 0.2):
        out = await art.gather_trajectory_groups(groups(), pbar_desc=None, max_exceptions=bound)
        assert [sorted(g.rewards) for g in out] == [[1.0, 3.0], [4.0, 5.0]]
        assert [len(g.exceptions) for g in out] == [1, 0]
    for bound in (0, 0.19):
        with pytest.raises(RuntimeError, match=r"rollout 2\.0 failed"):
            await art.gather_trajectory_groups(groups(), pbar_desc=None, max_exceptions=bound)


async def test_a_trajectory_that_cannot_give_exact_tokens_is_a_bad_rollout():
    async def half_built() -> art.Trajectory:
        return art.Trajectory(messages_and_choices=[{"role": "user", "content": "no choice yet"}])

    group = art.TrajectoryGroup([rollout(1.0), half_built()])
    out = await gather_groups([group], max_exceptions=1, progress=False)
    assert [g.rewards for g in out] == [[1.0]]
    assert "no choice" in str(out[0].exceptions[0])


async def test_gather_keeps_order_raises_when_nothing_survives_and_checks_its_bound():
    async def whole(reward: float) -> art.TrajectoryGroup:
        return await art.TrajectoryGroup([rollout(reward, delay=0.02 * (2 - reward))])

    out = await gather_groups([whole(0.0), whole(1.0), whole(2.0)], progress=False)
    assert [g.rewards for g in out] == [[0.0], [1.0], [2.0]]
    with pytest.raises(RuntimeError, match="failed"):
        await gather_groups(
            [art.TrajectoryGroup([rollout(0, fail=True)])], max_exceptions=5, progress=False
        )
    for bad in (-1, math.nan, True):
        with pytest.raises(ValueError, match="max_exceptions"):
            await gather_groups([], max_exceptions=bad, progress=False)


async def test_after_each_may_change_or_drop_groups():
    async def rescore(group: art.TrajectoryGroup) -> art.TrajectoryGroup | None:
        if max(group.rewards) > 5:
            return None
        for trajectory in group:
            trajectory.reward = trajectory.reward * 10
        return group

    out = await art.gather_trajectory_groups(
        [art.TrajectoryGroup([rollout(1.0)]), art.TrajectoryGroup([rollout(9.0)])],
        pbar_desc=None,
        after_each=rescore,
    )
    assert [g.rewards for g in out] == [[10.0]]


def test_hermes_tool_calls_are_parsed_or_left_as_text():
    content, calls = openai_tool_calls(
        'ok<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    )
    assert content == "ok" and len(calls) == 1
    assert calls[0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert openai_tool_calls("<tool_call>{not json}</tool_call>") == (
        "<tool_call>{not json}</tool_call>",
        [],
    )
    assert openai_tool_calls("plain") == ("plain", [])
