"""The endpoints' vLLM token-id fields, tool calls and request batching, through LocalBackend's
in-process endpoint and the real `openai` SDK."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from transformers import AutoTokenizer

from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.server.openai_api import encode_rendered

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def served(tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[TrainableModel]:
    backend = LocalBackend(tmp_path)
    model = TrainableModel(name="m", project="p", base_model=str(tiny_model_dir), lora_rank=4)
    await model.register(backend)
    yield model
    await backend.close()


def plain_client(model: TrainableModel) -> openai.AsyncOpenAI:
    """An SDK client without openai_client()'s defaults: what code written for vLLM sends."""
    endpoint = model.openai_endpoint()
    return openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)


async def test_return_token_ids_brings_logprobs_and_prompt_ids_on_every_choice(
    served: TrainableModel,
):
    plain = plain_client(served)
    without = await plain.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)
    assert without.choices[0].logprobs is None  # OpenAI's default: not asked, not sent
    asked = await plain.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=4,
        n=2,
        extra_body={"return_token_ids": True},
    )
    prompt = asked.model_extra["prompt_token_ids"]  # pyright: ignore[reportOptionalSubscript]
    for choice in asked.choices:  # vLLM's fields, and the prompt ids on each choice too
        extra = choice.model_extra or {}
        assert extra["prompt_token_ids"] == prompt and len(extra["token_ids"]) >= 1
        assert len(choice.logprobs.content) == len(extra["token_ids"])  # pyright: ignore[reportArgumentType, reportOptionalMemberAccess]
    # model.openai_client() asks by default; an explicit logprobs=False still wins.
    client = served.openai_client()
    default = await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)
    assert default.choices[0].logprobs is not None
    off = await client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=4,
        logprobs=False,
    )
    assert off.choices[0].logprobs is None
    text = await client.completions.create(model="m", prompt="hello", max_tokens=3)
    assert text.choices[0].logprobs is not None and text.choices[0].logprobs.token_logprobs


async def test_tokens_as_token_ids_and_stop_strings_kept_in_the_text(served: TrainableModel):
    client = served.openai_client()
    out = await client.completions.create(
        model="m",
        prompt="hello",
        max_tokens=5,
        seed=1,
        extra_body={"return_tokens_as_token_ids": True},
    )
    ids = out.choices[0].model_extra["token_ids"]  # pyright: ignore[reportOptionalSubscript]
    assert out.choices[0].logprobs.tokens == [f"token_id:{t}" for t in ids]  # pyright: ignore[reportOptionalMemberAccess]
    free = await client.completions.create(model="m", prompt="hello", max_tokens=30, seed=1)
    tokens = free.choices[0].model_extra["token_ids"]  # pyright: ignore[reportOptionalSubscript]
    at = next(i for i in range(2, 30) if 97 <= tokens[i] <= 122 and tokens[i] not in tokens[:i])
    stop = chr(tokens[at])
    kept = await client.completions.create(
        model="m",
        prompt="hello",
        max_tokens=30,
        seed=1,
        stop=[stop],
        extra_body={"include_stop_str_in_output": True},
    )
    cut = await client.completions.create(
        model="m", prompt="hello", max_tokens=30, seed=1, stop=[stop]
    )
    assert kept.choices[0].text.endswith(stop) and not cut.choices[0].text.endswith(stop)
    assert kept.choices[0].model_extra["token_ids"] == cut.choices[0].model_extra["token_ids"]  # pyright: ignore[reportOptionalSubscript]


async def test_chat_template_kwargs_and_tools_reach_the_template(served: TrainableModel):
    client = served.openai_client()
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(
            model="m",
            messages=MESSAGES,
            extra_body={"chat_template_kwargs": {"tokenize": False}},
        )
    assert err.value.param == "chat_template_kwargs" and "tokenize" in err.value.message
    tool: ChatCompletionToolParam = {
        "type": "function",
        "function": {"name": "add", "parameters": {"type": "object"}},
    }
    out = await client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        tools=[tool],
        max_tokens=3,
        extra_body={"chat_template_kwargs": {"x": 1}},
    )
    assert out.choices[0].model_extra["token_ids"]  # pyright: ignore[reportOptionalSubscript]
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(
            model="m", messages=MESSAGES, tools=[tool], tool_choice="required"
        )
    assert err.value.param == "tool_choice"


def test_encode_rendered_equals_the_templates_own_tokenization(tiny_model_dir: Path):
    from chat_model import ADD_TOOL, TOOL_TEMPLATE

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    conversation = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "héllo <|im_start|> wörld"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "add", "arguments": {"a": 1}}}],
        },
        {"role": "tool", "content": "1"},
    ]
    for template in (tokenizer.chat_template, TOOL_TEMPLATE):
        kwargs = {"chat_template": template, "tools": [ADD_TOOL], "add_generation_prompt": True}
        text = tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)
        expected = tokenizer.apply_chat_template(
            conversation, tokenize=True, return_dict=False, **kwargs
        )
        assert encode_rendered(tokenizer, text) == list(expected)


async def test_a_bad_request_among_concurrent_ones_fails_alone(served: TrainableModel):
    client = served.openai_client()
    too_long = [65] * 600  # the tiny model has 512 positions

    async def ask(prompt: list[int]) -> list[int] | str:
        try:
            out = await client.completions.create(model="m", prompt=prompt, max_tokens=4)
        except openai.BadRequestError as exc:
            return exc.message
        return out.choices[0].model_extra["token_ids"]  # pyright: ignore[reportOptionalSubscript]

    answers = await asyncio.gather(*(ask(too_long if i == 3 else [65, 66, i]) for i in range(8)))
    assert isinstance(answers[3], str) and "prompt" in answers[3]
    assert all(isinstance(a, list) and a for i, a in enumerate(answers) if i != 3)
