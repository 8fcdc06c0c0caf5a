"""TrajectoryBuilder on the tiny tokenizer's chat template, and gather_groups."""

from __future__ import annotations

import asyncio

import pytest

from posttrain.engine.models import load_tokenizer
from posttrain.engine.tiny import CHAT_TEMPLATE, build_tokenizer
from posttrain.rollout import TrajectoryBuilder, assistant_closing, gather_groups
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


# posttrain's tiny template with Qwen's newline after each turn's end-of-turn token.
NEWLINE_TEMPLATE = CHAT_TEMPLATE.replace("eos_token -}}", "eos_token + '\\n' -}}")


@pytest.fixture(params=["tiny", "newline"])
def template(request):
    """(tokenizer, the tokens the template puts after a turn's content)."""
    tok = build_tokenizer()
    eos = tok.eos_token_id
    if request.param == "newline":
        tok.chat_template = NEWLINE_TEMPLATE
        return tok, [eos, ord("\n")]
    return tok, [eos]


def special(tok, name: str) -> int:
    return tok.convert_tokens_to_ids(name)


def test_assistant_closing_is_what_follows_the_content(template):
    tok, closing = template
    assert assistant_closing(tok) == tuple(closing)


def test_next_turn_follows_the_exact_sampled_tokens(template):
    """A completion cut by max_tokens gets the end-of-turn token (and what follows it) before
    the next message; one that stopped on EOS keeps its EOS once, plus the rest of the ending.
    Expected tokens written out by hand: the byte tokenizer has one token per character."""
    tok, closing = template
    bos, eos, start = special(tok, "<|bos|>"), tok.eos_token_id, special(tok, "<|im_start|>")
    tail = closing[1:]  # [] for the tiny template, [ord("\n")] for the newline one

    def turn(role: str, text: str) -> list[int]:
        return [start, *f"{role}\n{text}".encode(), eos, *tail]

    generation = [start, *b"assistant\n"]
    builder = TrajectoryBuilder(tok)
    assert builder.prompt({"role": "user", "content": "hi"}) == [
        bos,
        *turn("user", "hi"),
        *generation,
    ]
    cut = SampledSequence("length", list(b"abc"), [-1.0] * 3)  # no EOS: max_tokens reached
    assert builder.completion(cut) == "abc"
    second = builder.prompt({"role": "user", "content": "more"})
    assert second == [bos, *turn("user", "hi"), *generation, *b"abc", eos, *tail,
                      *turn("user", "more"), *generation]  # fmt: skip
    stopped = SampledSequence("stop", [*b"de", eos], [-1.0] * 3)  # ended on EOS
    assert builder.completion(stopped) == "de"
    third = builder.prompt({"role": "tool", "content": "t"})
    assert third == [*second, *b"de", eos, *tail, *turn("tool", "t"), *generation]
    trajectory = builder.build(reward=1.0)
    assert trajectory.tokens == third
    # Only the sampled tokens train; the EOS added after the cut completion is context.
    trainable = [list(s.tokens) for s in trajectory.segments if s.trainable]
    assert trainable == [list(b"abc"), [*b"de", eos]]
    assert [s.trainable for s in trajectory.segments] == [False, True, False, True, False]
    assert trajectory.segments[2].tokens[: len(closing)] == (eos, *tail)
    # What the model saw equals the template's rendering of the conversation it decoded.
    messages = [dict(m) for m in trajectory.messages]
    assert third == tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_two_prompts_in_a_row_drop_the_first_generation_prompt(template):
    tok, _ = template
    builder = TrajectoryBuilder(tok)
    builder.prompt({"role": "system", "content": "s"})
    tokens = builder.prompt({"role": "user", "content": "u"})
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert tokens == tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


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
