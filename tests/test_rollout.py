"""TrajectoryBuilder on the tiny tokenizer's chat template, and gather_groups."""

from __future__ import annotations

import asyncio

import pytest

from posttrain.engine.models import load_tokenizer
from posttrain.rollout import TrajectoryBuilder, gather_groups
from posttrain.types import SampledSequence, TokenSegment, Trajectory, TrajectoryGroup


def sampled(tokenizer, text: str) -> SampledSequence:
    tokens = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    return SampledSequence("stop", tokens, [-0.5] * len(tokens))


def test_multi_turn_keeps_sampled_tokens_and_masks_the_rest(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    builder = TrajectoryBuilder(tok)
    first = builder.prompt({"role": "user", "content": "2+2?"})
    assert first == tok.apply_chat_template(
        [{"role": "user", "content": "2+2?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert builder.completion(sampled(tok, "4")) == "4"
    builder.prompt({"role": "tool", "content": "ok"})
    builder.completion(sampled(tok, "done"))
    traj = builder.build(reward=1.0)
    assert [s.trainable for s in traj.segments] == [False, True, False, True]
    # The exact tokens equal the template's rendering of the whole conversation.
    rendered = tok.apply_chat_template(
        [dict(m) for m in traj.messages], tokenize=True, return_dict=False
    )
    assert traj.tokens == list(rendered)
    assert traj.num_trainable_tokens == 2 + 5  # "4"+EOS, "done"+EOS


def test_trainable_completion_needs_logprobs(tiny_model_dir):
    builder = TrajectoryBuilder(load_tokenizer(tiny_model_dir))
    builder.prompt({"role": "user", "content": "x"})
    with pytest.raises(ValueError, match="logprobs"):
        builder.completion(SampledSequence("stop", [65], None))


def group(reward: float) -> TrajectoryGroup:
    return TrajectoryGroup((Trajectory((TokenSegment((1, 2)),), reward),))


async def test_gather_groups_keeps_order_and_tolerates_failures():
    async def ok(r: float, delay: float) -> TrajectoryGroup:
        await asyncio.sleep(delay)
        return group(r)

    async def boom() -> TrajectoryGroup:
        raise RuntimeError("rollout failed")

    out = await gather_groups(
        [ok(1.0, 0.02), boom(), ok(2.0, 0.0)], max_exceptions=1, progress=False
    )
    assert [g.rewards for g in out] == [[1.0], [2.0]]
    with pytest.raises(RuntimeError, match="rollout failed"):
        await gather_groups([ok(1.0, 0.0), boom()], max_exceptions=0, progress=False)
