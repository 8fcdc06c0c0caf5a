"""TrajectoryBuilder on the tiny tokenizer's chat template, and gather_groups."""

from __future__ import annotations

import asyncio

import pytest

from chat_templates import TEMPLATES, Template, tools_tokenizer
from chat_templates import template as chat_template
from posttrain.data.trajectories import TokenSegment, Trajectory, TrajectoryGroup
from posttrain.models.load import load_tokenizer
from posttrain.models.tiny import build_tokenizer
from posttrain.rollouts.builder import TrajectoryBuilder
from posttrain.rollouts.gather import gather_groups
from posttrain.tokenizer import TurnClosing, assistant_closing, render_chat
from posttrain.types import SampledSequence


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
        [dict(m) for m in traj.messages],  # pyright: ignore[reportArgumentType]  # role/content strings
        tokenize=True,
        return_dict=False,
    )
    assert traj.tokens == list(rendered)
    assert traj.num_trainable_tokens == 2 + 5  # "4"+EOS, "done"+EOS


@pytest.fixture(params=sorted(TEMPLATES))
def template(request) -> Template:
    return chat_template(request.param)


def special(tok, name: str) -> int:
    return tok.convert_tokens_to_ids(name)


def test_assistant_closing_is_cut_after_the_end_of_turn_token(template):
    tok = template.tokenizer
    assert assistant_closing(tok) == TurnClosing(
        (*template.before_end, tok.eos_token_id), template.after_end
    )


def _turn(tok, role: str, text: str, template: Template) -> list[int]:
    """A whole message as the template renders it, by hand (one token per character)."""
    before = template.before_end if role == "assistant" else ()
    start, eos = special(tok, "<|im_start|>"), tok.eos_token_id
    return [start, *f"{role}\n{text}".encode(), *before, eos, *template.after_end]


def test_next_turn_follows_the_exact_sampled_tokens(template):
    """A completion cut by max_tokens gets the template's whole closing (the end-of-turn token,
    what comes before and after it) before the next message; one that stopped on EOS keeps
    what it sampled, plus what follows the EOS. Expected tokens written out by hand."""
    tok, before, after = template.tokenizer, template.before_end, template.after_end
    bos, eos = special(tok, "<|bos|>"), tok.eos_token_id
    generation = [special(tok, "<|im_start|>"), *b"assistant\n"]
    builder = TrajectoryBuilder(tok)
    first = builder.prompt({"role": "user", "content": "hi"})
    assert first == [bos, *_turn(tok, "user", "hi", template), *generation]
    cut = SampledSequence("length", list(b"abc"), [-1.0] * 3)  # no EOS: max_tokens reached
    assert builder.completion(cut) == "abc"
    second = builder.prompt({"role": "user", "content": "more"})
    assert second == [*first, *b"abc", *before, eos, *after,
                      *_turn(tok, "user", "more", template), *generation]  # fmt: skip
    stopped = SampledSequence("stop", [*b"de", *before, eos], [-1.0] * (3 + len(before)))
    assert builder.completion(stopped).strip() == "de"
    third = builder.prompt({"role": "tool", "content": "t"})
    assert third == [*second, *b"de", *before, eos, *after,
                     *_turn(tok, "tool", "t", template), *generation]  # fmt: skip
    trajectory = builder.build(reward=1.0)
    assert trajectory.tokens == third
    # Only the sampled tokens train; the closing added after the cut completion is context.
    trainable = [list(s.tokens) for s in trajectory.segments if s.trainable]
    assert trainable == [list(b"abc"), [*b"de", *before, eos]]
    assert [s.trainable for s in trajectory.segments] == [False, True, False, True, False]
    # What the model saw equals the template's rendering of the conversation it decoded.
    messages = [dict(m) for m in trajectory.messages]
    assert third == tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )


def test_a_stop_on_eos_gets_no_second_eos():
    """Llama 2's template puts a space before EOS; a completion that stopped on EOS without
    sampling the space still ended its turn: only what follows EOS (nothing) is added."""
    template = chat_template("llama2")
    tok = template.tokenizer
    eos = special(tok, "<|eos|>")
    builder = TrajectoryBuilder(tok)
    first = builder.prompt({"role": "user", "content": "hi"})
    builder.completion(SampledSequence("stop", [*b"de", eos], [-1.0] * 3))
    second = builder.prompt({"role": "user", "content": "more"})
    assert second[len(first) :][:4] == [*b"de", eos, special(tok, "<|im_start|>")]


def test_two_prompts_in_a_row_drop_the_first_generation_prompt(template):
    tok = template.tokenizer
    builder = TrajectoryBuilder(tok)
    builder.prompt({"role": "system", "content": "s"})
    tokens = builder.prompt({"role": "user", "content": "u"})
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert tokens == tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    # A fork after a prompt drops its generation prompt the same way.
    fork = builder.fork()
    assert fork.prompt({"role": "user", "content": "v"}) == tok.apply_chat_template(
        [*messages, {"role": "user", "content": "v"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )


def test_a_prompt_the_template_cannot_extend_changes_nothing():
    tok = build_tokenizer()
    builder = TrajectoryBuilder(tok)
    first = builder.prompt({"role": "user", "content": "hi"})
    # A template that renders the conversation so far differently once a message is added.
    tok.chat_template = (
        "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(ValueError, match="cannot be extended turn by turn"):
        builder.prompt({"role": "user", "content": "more"})
    assert builder.tokens == first and len(builder.messages) == 1


def test_renders_per_prompt(monkeypatch):
    """A first prompt renders the conversation once; a later one twice (the conversation so
    far, then with the new messages), plus twice once for the template's closing."""
    tok = build_tokenizer()
    renders = []
    render = tok.apply_chat_template
    monkeypatch.setattr(
        tok, "apply_chat_template", lambda *a, **k: renders.append(1) or render(*a, **k)
    )
    builder = TrajectoryBuilder(tok)
    counts = []
    for text in ("a", "b", "c"):
        renders.clear()
        builder.prompt({"role": "user", "content": text})
        counts.append(len(renders))
        builder.completion(SampledSequence("stop", [*b"ok", special(tok, "<|eos|>")], [-1.0] * 3))
    assert counts == [1, 2 + 2, 2]


def test_trainable_completion_needs_logprobs(tiny_model_dir):
    builder = TrajectoryBuilder(load_tokenizer(tiny_model_dir))
    builder.prompt({"role": "user", "content": "x"})
    with pytest.raises(ValueError, match="logprobs"):
        builder.completion(SampledSequence("stop", [65], None))


TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def test_a_tool_trajectory_trains_exactly_the_sampled_assistant_tokens():
    """A call to two tools, their results in one prompt (the template puts them in one user
    turn), then the answer, on a Qwen-style tools template: token for token, the trajectory is
    the template's rendering of the conversation as sampled, and its trainable tokens are the
    two sampled turns and nothing else. The call is recorded as parsed `tool_calls`, which the
    template renders otherwise than sampled: the tokens never come from that rendering."""
    tok = tools_tokenizer()
    eos = tok.eos_token_id
    builder = TrajectoryBuilder(tok, tools=TOOLS)
    system, user = {"role": "system", "content": "s"}, {"role": "user", "content": "1+2, 3+4?"}
    first = builder.prompt(system, user)
    assert first == render_chat(tok, [system, user], True, tools=TOOLS)
    assert "# Tools" in tok.decode(first)  # the tools reached the template
    call = '<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call><tool_call>{"name":"add","arguments":{"a":3,"b":4}}</tool_call>'
    call_tokens = [*call.encode(), eos]
    text = builder.completion(SampledSequence("stop", call_tokens, [-0.5] * len(call_tokens)))
    assert text == call
    parsed = [
        {"id": f"call0000{i}", "type": "function",
         "function": {"name": "add", "arguments": {"a": a, "b": b}}}
        for i, (a, b) in enumerate([(1, 2), (3, 4)])
    ]  # fmt: skip
    builder.set_completion_message({"role": "assistant", "content": "", "tool_calls": parsed})
    results = [
        {"role": "tool", "tool_call_id": f"call0000{i}", "name": "add", "content": value}
        for i, value in enumerate(["3", "7"])
    ]
    builder.prompt(*results)
    answer = [*b"3 and 7", eos]
    builder.completion(SampledSequence("stop", answer, [-0.5] * len(answer)))
    trajectory = builder.build(1.0)

    as_sampled = [
        system, user, {"role": "assistant", "content": call}, *results,
        {"role": "assistant", "content": "3 and 7"},
    ]  # fmt: skip
    rendered = render_chat(tok, as_sampled, False, tools=TOOLS)
    assert rendered == [*trajectory.tokens, ord("\n")]  # it ends at the EOS it sampled
    # Trainable: exactly the positions of the two sampled turns in that rendering.
    mask = [trainable for s in trajectory.segments for trainable in [s.trainable] * len(s.tokens)]
    start = len(first)
    second = len(rendered) - 1 - len(answer)
    expected = [start <= i < start + len(call_tokens) or i >= second for i in range(len(mask))]
    assert mask == expected
    assert [s.logprobs is not None for s in trajectory.segments] == [False, True, False, True]
    # Between the turns: Qwen's newline after EOS, then one user turn of both results.
    between = trajectory.segments[2].tokens
    assert tok.decode(list(between)) == (
        "\n<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n7\n"
        "</tool_response><|eos|>\n<|im_start|>assistant\n"
    )
    assert trajectory.messages[2]["tool_calls"] == parsed
    assert render_chat(tok, trajectory.messages, False, tools=TOOLS) != rendered
    assert builder.fork().tools == TOOLS


def test_set_completion_message_needs_a_completion_and_an_assistant_message():
    builder = TrajectoryBuilder(build_tokenizer())
    with pytest.raises(ValueError, match="needs a completion"):
        builder.set_completion_message({"role": "assistant", "content": "x"})
    builder.prompt({"role": "user", "content": "x"})
    builder.completion(SampledSequence("stop", [65, 257], [-1.0, -1.0]))
    with pytest.raises(ValueError, match="takes an assistant message, got role 'tool'"):
        builder.set_completion_message({"role": "tool", "content": "x"})


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
