"""The rollout runner: multi-turn tool trajectories on exact tokens (checked token by token
against the chat template's rendering), limits and stop reasons, environments that fail, and
episodes on LocalBackend that train a step."""

from __future__ import annotations

import asyncio
import math
import re
from typing import ClassVar

import pytest

from chat_templates import tools_tokenizer
from posttrain.environments import (
    CalculatorEnv,
    EpisodeError,
    EpisodeLimits,
    Reset,
    Step,
    evaluate_environment,
    run_episodes,
)
from posttrain.models.tiny import build_tokenizer
from posttrain.rollouts.sft_data import conversation_to_trajectory
from posttrain.tokenizer import render_chat
from posttrain.types import SampledSequence, SampleResponse, SamplingParams

PARAMS = SamplingParams(max_tokens=96, temperature=1.0, seed=5)


class ScriptedSampler:
    """Answers turn t with `turns[t]` (one text for every episode, or one per episode still
    going); a text ending in "|len" was cut by max_tokens (no EOS)."""

    policy_version: int | None = None  # no trainer behind it

    def __init__(self, tokenizer, turns: list[str | list[str]]) -> None:
        self.tokenizer = tokenizer
        self.turns = turns
        self.calls: list[tuple[list[list[int]], int, SamplingParams]] = []

    def sequence(self, text: str) -> SampledSequence:
        cut = text.endswith("|len")
        tokens = list(text.removesuffix("|len").encode())
        if not cut:
            tokens.append(self.tokenizer.eos_token_id)
        return SampledSequence("length" if cut else "stop", tokens, [-0.25] * len(tokens))

    async def sample_many(self, prompts, num_samples, params):
        script = self.turns[len(self.calls)]
        self.calls.append(([list(p) for p in prompts], num_samples, params))
        texts = [script] * len(prompts) if isinstance(script, str) else script
        return [SampleResponse([self.sequence(t)]) for t in texts]


def tool_call(expression: str) -> str:
    return f'<tool_call>{{"name":"calculator","arguments":{{"expression":"{expression}"}}}}</tool_call>'


def flat(trajectory) -> list[tuple[int, bool]]:
    return [(t, s.trainable) for s in trajectory.segments for t in s.tokens]


async def test_a_tool_episode_trains_exactly_the_sampled_assistant_tokens():
    """Two turns of a calculator episode on a Qwen-style tools template: the trajectory's
    tokens are the template's rendering of the conversation as sampled, token for token, and
    the trainable ones are exactly the two sampled turns (the tool result, the template's
    tokens and the tools' system turn are context). The recorded messages hold the parsed
    tool_calls, which that template would render otherwise: tokens are never re-rendered."""
    tok = tools_tokenizer()
    env = CalculatorEnv(system_prompt="Add.")
    expression = str(env.reset(1, "train").messages[-1]["content"])[len("What is ") : -1]
    answer = str(int(env.answer))
    first = tool_call(expression)  # compact JSON, as a model may write it
    sampler = ScriptedSampler(tok, [first, answer])
    played = await run_episodes(sampler, lambda: CalculatorEnv(system_prompt="Add."), [1], PARAMS)
    (group,) = played.groups
    (trajectory,) = group.trajectories
    assert trajectory.reward == 1.0 and played.errors == []
    assert trajectory.metadata == {"seed": 1, "stop_reason": "done"}
    assert trajectory.metrics["turns"] == 2 and trajectory.metrics["tool_calls"] == 1

    eos = tok.eos_token_id
    sampled = [*first.encode(), eos, *answer.encode(), eos]
    assert [t for t, trainable in flat(trajectory) if trainable] == sampled
    assert all(s.logprobs is not None for s in trajectory.segments if s.trainable)
    # The conversation as sampled, rendered whole by the template with the same tools.
    reset = CalculatorEnv(system_prompt="Add.").reset(1, "train")
    as_sampled = [
        *reset.messages,
        {"role": "assistant", "content": first},
        {"role": "tool", "tool_call_id": "call00000", "name": "calculator", "content": answer},
        {"role": "assistant", "content": answer},
    ]
    rendered = render_chat(tok, as_sampled, False, tools=reset.tools)
    assert rendered == [*trajectory.tokens, ord("\n")]  # it ends at the EOS it sampled
    # Which tokens are trainable, by an independent rule: the SFT converter's.
    expected = conversation_to_trajectory(as_sampled, tok, tools=reset.tools)
    assert flat(trajectory) == flat(expected)
    # The second prompt was the first one, the sampled turn, "\n" and the tool's user turn.
    second_prompt = sampler.calls[1][0][0]
    tool_turn = "\n<|im_start|>user\n<tool_response>\n" + answer + "\n</tool_response>"
    assert tok.decode(second_prompt[len(sampler.calls[0][0][0]) + len(first) + 1 :]) == (
        tool_turn + "<|eos|>\n<|im_start|>assistant\n"
    )
    recorded = trajectory.messages[len(reset.messages)]
    assert recorded["tool_calls"][0]["function"]["arguments"] == {"expression": expression}  # pyright: ignore[reportIndexIssue]
    assert render_chat(tok, trajectory.messages, False, tools=reset.tools) != rendered


async def test_episodes_are_batched_per_turn_and_grouped_per_seed():
    tok = build_tokenizer()
    # Turn 0: 2 seeds x 3 episodes; the first episode of each seed answers at once, the others
    # call the tool and answer next turn (4 still going).
    texts = ["7", tool_call("1+1"), tool_call("2+2")] * 2
    sampler = ScriptedSampler(tok, [texts, "4"])
    played = await run_episodes(sampler, CalculatorEnv, [3, 4], PARAMS, group_size=3)
    assert [len(g) for g in played.groups] == [3, 3] and played.episodes == 6
    assert [(len(p), n) for p, n, _ in sampler.calls] == [(6, 1), (4, 1)]
    # Each turn samples with its own seed, derived from the params' seed.
    seeds = [params.seed for _, _, params in sampler.calls]
    assert len(set(seeds)) == 2 and PARAMS.seed not in seeds
    assert [t.metrics["turns"] for g in played.groups for t in g.trajectories] == [1, 2, 2] * 2
    # A group's first prompts are the same episode: its seed's question.
    prompts = sampler.calls[0][0]
    assert prompts[0] == prompts[1] == prompts[2] != prompts[3]


async def test_limits_stop_an_episode_which_keeps_what_it_sampled():
    tok = build_tokenizer()
    sampler = ScriptedSampler(tok, [tool_call("1+1")] * 3)
    played = await run_episodes(
        sampler, CalculatorEnv, [0], PARAMS, limits=EpisodeLimits(max_turns=3)
    )
    (trajectory,) = played.groups[0].trajectories
    assert trajectory.metadata["stop_reason"] == "max_turns"
    assert [trajectory.metrics[f"stop_{s}"] for s in ("done", "max_turns", "context")] == [0, 1, 0]
    assert sum(s.trainable for s in trajectory.segments) == 3
    # It ends with the last sampled turn: the tool's answer to it is not part of it.
    assert trajectory.segments[-1].trainable and trajectory.reward == 0.0
    assert trajectory.metrics["tool_calls"] == 3

    # Context: the first prompt and one turn fit 300 tokens, the second prompt does not.
    first_prompt = len(sampler.calls[0][0][0])
    limits = EpisodeLimits(max_turns=8, max_context=first_prompt + 96 + 10)
    sampler = ScriptedSampler(tok, [tool_call("1+1")] * 3)
    played = await run_episodes(sampler, CalculatorEnv, [0], PARAMS, limits=limits)
    (trajectory,) = played.groups[0].trajectories
    assert trajectory.metadata["stop_reason"] == "context" and len(sampler.calls) == 1
    assert len(trajectory.tokens) == first_prompt + len(tool_call("1+1")) + 1
    # A first prompt that leaves no room for a turn is the episode's error.
    small = EpisodeLimits(max_context=first_prompt + 95)
    with pytest.raises(EpisodeError, match=r"the first prompt .* do not fit max_context"):
        await run_episodes(ScriptedSampler(tok, []), CalculatorEnv, [0], PARAMS, limits=small)


class Flaky:
    """Answers "ok" turns with a user turn, then ends with reward 0.5; misbehaves as told on
    seed 13. Async methods and a close(), to show both are awaited."""

    closed: ClassVar[list[int]] = []

    def __init__(self, fault: str = "raise") -> None:
        self.fault, self.seed = fault, -1

    async def reset(self, seed, split):
        self.seed = seed
        if seed == 13 and self.fault == "reset":
            return [{"role": "user", "content": "hi"}]  # not a Reset
        return Reset([{"role": "user", "content": f"say ok ({seed})"}])

    async def step(self, message):
        if self.seed == 13:
            if self.fault == "raise":
                raise RuntimeError("the sandbox died")
            if self.fault == "nan":
                return Step(reward=math.nan, done=True)
            if self.fault == "no content":
                return Step(messages=[{"role": "user"}])
            if self.fault == "type":
                return {"reward": 1.0}
        return Step(reward=0.5, done=True)

    async def close(self):
        Flaky.closed.append(self.seed)


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("raise", "step raised RuntimeError: the sandbox died"),
        ("nan", "step raised ValueError: Step.reward must be a finite number"),
        ("no content", "the chat template cannot add the environment's messages"),
        ("type", "step\\(\\) returned a dict; return posttrain.environments.Step"),
        ("reset", "reset\\(\\) returned a list; return posttrain.environments.Reset"),
    ],
)
async def test_a_failing_episode_is_dropped_whole_and_reported(fault, message):
    tok = build_tokenizer()
    Flaky.closed = []
    sampler = ScriptedSampler(tok, ["ok", "ok"])
    played = await run_episodes(
        sampler, lambda: Flaky(fault), [12, 13], PARAMS, group_size=2, max_exceptions=None,  # pyright: ignore[reportArgumentType]
        name="flaky",
    )  # fmt: skip
    assert len(played.errors) == 2 and played.episodes == 4
    assert all(isinstance(e, EpisodeError) for e in played.errors)
    assert "environment 'flaky', seed 13" in str(played.errors[0])
    assert re.search(message, str(played.errors[0])), str(played.errors[0])
    # Seed 13's group is gone; seed 12's is whole. Every environment was closed.
    assert [g.rewards for g in played.groups] == [[0.5, 0.5]]
    assert sorted(Flaky.closed) == [12, 12, 13, 13]
    # By default (max_exceptions=0) one failure raises.
    with pytest.raises(EpisodeError, match="seed 13"):
        await run_episodes(ScriptedSampler(tok, ["ok"]), lambda: Flaky(fault), [12, 13], PARAMS)  # pyright: ignore[reportArgumentType]


async def test_a_factory_that_fails_or_makes_no_environment_is_an_episode_error():
    sampler = ScriptedSampler(build_tokenizer(), [])
    with pytest.raises(EpisodeError, match="the factory made a object, which lacks reset, step"):
        await run_episodes(sampler, object, [0], PARAMS)  # pyright: ignore[reportArgumentType]

    def broken():
        raise OSError("no sandbox left")

    with pytest.raises(EpisodeError, match="seed 0, turn 0: the factory raised OSError: no sand"):
        await run_episodes(sampler, broken, [0], PARAMS)


class Count:
    """Two turns: "count" then "again"; the reward is the share of digits in both answers, so
    an untrained model's samples get rewards that differ within a group."""

    def __init__(self) -> None:
        self.turn, self.digits, self.chars = 0, 0, 0

    def reset(self, seed, split):
        return Reset([{"role": "user", "content": f"count from {seed % 10}"}])

    def step(self, message):
        text = message["content"]
        self.turn += 1
        self.digits += sum(c.isdigit() for c in text)
        self.chars += max(len(text), 1)
        if self.turn == 1:
            return Step(messages=[{"role": "user", "content": "again"}], metrics={"x": 1.0})
        return Step(reward=self.digits / self.chars, done=True, metrics={"x": 2.0})


async def test_episodes_on_local_backend_are_reproducible_and_train_a_step(
    tiny_model_dir, tmp_path
):
    import posttrain

    backend = posttrain.LocalBackend(tmp_path)
    model = posttrain.TrainableModel(
        name="m", project="p", base_model=str(tiny_model_dir), lora_rank=8
    )
    await model.register(backend)
    try:
        sampler = backend.sampling_client(model)
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=3)
        played, again = [
            await run_episodes(sampler, Count, [1, 2], params, group_size=4) for _ in range(2)
        ]
        assert [[t.tokens for t in g.trajectories] for g in played.groups] == [
            [t.tokens for t in g.trajectories] for g in again.groups
        ]
        trajectories = [t for g in played.groups for t in g.trajectories]
        assert len(trajectories) == 8
        assert all(sum(s.trainable for s in t.segments) == 2 for t in trajectories)
        assert all(t.metrics["x"] == 3.0 for t in trajectories)  # summed over the 2 steps
        assert len({t.reward for t in trajectories}) > 1  # something to learn from
        result = await backend.train(model, played.groups, learning_rate=1e-3)
        metrics = result.metrics
        assert metrics["num_trajectories"] == 8
        assert metrics["num_trainable_tokens"] == sum(t.num_trainable_tokens for t in trajectories)
        # The trainer scored the sampled tokens as the sampler did: every importance ratio is 1
        # up to float32 noise (the same weights, the same tokens, two code paths).
        assert metrics["ratio"] == pytest.approx(1.0, abs=1e-4)
        after = await evaluate_environment(sampler, Count, [7, 8], max_tokens=8)
        assert len(after.trajectories) == 2 and 0 <= after.mean_reward <= 1
    finally:
        await backend.close()


def test_run_episodes_checks_its_arguments():
    sampler = ScriptedSampler(build_tokenizer(), [])
    for kwargs, message in [
        ({"group_size": 0}, "group_size must be >= 1"),
        ({"split": "dev"}, "split must be one of"),
    ]:
        with pytest.raises(ValueError, match=message):
            asyncio.run(run_episodes(sampler, CalculatorEnv, [0], PARAMS, **kwargs))
    with pytest.raises(ValueError, match=r"needs SamplingParams\.max_tokens"):
        asyncio.run(
            run_episodes(
                sampler, CalculatorEnv, [0], SamplingParams(), limits=EpisodeLimits(max_context=9)
            )
        )
    with pytest.raises(ValueError, match="max_turns must be >= 1"):
        EpisodeLimits(max_turns=0)
