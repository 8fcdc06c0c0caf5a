"""The OpenAI-compatible router under real uvicorn on loopback, driven by the real `openai` SDK.

The source serves one tiny model's LocalTrainingClient under two names owned by two API keys.
Every sampled result is compared with in-process sampling through the same client and seed.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from openai.types.chat import ChatCompletionMessageParam
from transformers import PreTrainedTokenizerBase

from posttrain.clients.create import create_training_client
from posttrain.clients.local import LocalTrainingClient
from posttrain.inference.model_sampler import ModelSampler
from posttrain.server.local_openai import LoopbackServer
from posttrain.server.openai_api import create_openai_router
from posttrain.server.sources import UnknownModelError
from posttrain.types import SamplingParams

PROMPT = [104, 101, 108, 108, 111, 32]  # "hello " in the tiny byte-level vocabulary
OWNERS = {"tiny": "alice", "tiny-bob": "bob"}


class OwnedSource:
    """A SamplerSource: each name belongs to one owner; others see it as absent."""

    def __init__(self, client: LocalTrainingClient) -> None:
        self.sampling = ModelSampler(client, client.get_tokenizer())

    def model_names(self, owner: str | None) -> list[str]:
        return [name for name, who in OWNERS.items() if who == owner]

    def sampler(self, name: str, owner: str | None) -> ModelSampler:
        if OWNERS.get(name) != owner:
            raise UnknownModelError(name)
        return self.sampling


@pytest.fixture(scope="module")
def client(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalTrainingClient]:
    training = create_training_client(
        tiny_model_dir, lora_rank=4, storage_dir=tmp_path_factory.mktemp("openai-api")
    )
    yield training
    training.close()


@pytest.fixture(scope="module")
def url(client: LocalTrainingClient) -> Iterator[str]:
    app = FastAPI()

    @app.middleware("http")
    async def owner_from_key(request: Request, call_next):
        # What the Tinker server's auth middleware does: the caller's key is its identity.
        request.state.owner = request.headers.get("authorization", "").removeprefix("Bearer ")
        return await call_next(request)

    app.include_router(create_openai_router(OwnedSource(client)))
    server = LoopbackServer(app)
    yield server.url
    server.stop()


@pytest.fixture
def oai(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="alice", max_retries=0)


def in_process(client: LocalTrainingClient) -> ModelSampler:
    return ModelSampler(client, client.get_tokenizer())


def tokenizer_of(client: LocalTrainingClient) -> PreTrainedTokenizerBase:
    tokenizer = client.get_tokenizer()
    assert isinstance(tokenizer, PreTrainedTokenizerBase)
    return tokenizer


async def test_models_are_per_owner(oai: openai.AsyncOpenAI, url: str) -> None:
    assert [m.id for m in (await oai.models.list()).data] == ["tiny"]
    assert (await oai.models.retrieve("tiny")).owned_by == "posttrain"
    bob = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bob", max_retries=0)
    assert [m.id for m in (await bob.models.list()).data] == ["tiny-bob"]
    # Another key's model is absent, exactly as a name nobody serves.
    with pytest.raises(openai.NotFoundError) as err:
        await oai.completions.create(model="tiny-bob", prompt=PROMPT)
    assert err.value.code == "model_not_found" and err.value.param == "model"
    assert "served models: tiny" in err.value.message and "tiny-bob'" in err.value.message


async def test_completion_equals_in_process_sampling(
    oai: openai.AsyncOpenAI, client: LocalTrainingClient
) -> None:
    out = await oai.completions.create(
        model="tiny", prompt=PROMPT, n=3, seed=7, max_tokens=6, logprobs=0, temperature=0.9
    )
    expected = await in_process(client).sample(
        PROMPT, 3, SamplingParams(max_tokens=6, seed=7, temperature=0.9)
    )
    tokenizer = tokenizer_of(client)
    assert out.object == "text_completion" and out.model == "tiny"
    assert out.model_extra is not None and out.model_extra["prompt_token_ids"] == PROMPT
    assert [c.index for c in out.choices] == [0, 1, 2]
    for choice, sequence in zip(out.choices, expected.sequences, strict=True):
        assert choice.model_extra is not None
        assert choice.model_extra["token_ids"] == sequence.tokens
        assert choice.model_extra["prompt_token_ids"] == PROMPT
        # float32 logprobs survive JSON (repr of a float64) exactly.
        assert choice.logprobs is not None and choice.logprobs.token_logprobs == sequence.logprobs
        assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in sequence.tokens]
        assert choice.text == tokenizer.decode(sequence.tokens, skip_special_tokens=True)
        assert choice.finish_reason == "length" == sequence.stop_reason  # 6 tokens, no EOS
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(PROMPT), 18)


async def test_penalties_and_min_p_are_honoured_as_in_process(
    oai: openai.AsyncOpenAI, client: LocalTrainingClient
) -> None:
    """OpenAI's presence/frequency penalties and vLLM's min_p/repetition_penalty reach the
    sampler: the tokens are in-process sampling's with the same settings, not without them."""
    extension = {"min_p": 0.05, "repetition_penalty": 1.5}
    out = await oai.completions.create(
        model="tiny",
        prompt=PROMPT,
        n=2,
        seed=7,
        max_tokens=12,
        presence_penalty=1.2,
        frequency_penalty=0.6,
        extra_body=extension,
    )
    got = [c.model_extra["token_ids"] for c in out.choices]  # pyright: ignore[reportOptionalSubscript]
    base = SamplingParams(max_tokens=12, seed=7)
    expected = await in_process(client).sample(
        PROMPT,
        2,
        dataclasses.replace(base, presence_penalty=1.2, frequency_penalty=0.6, **extension),
    )
    plain = await in_process(client).sample(PROMPT, 2, base)
    assert got == [s.tokens for s in expected.sequences] != [s.tokens for s in plain.sequences]
    with pytest.raises(openai.BadRequestError) as err:
        await oai.completions.create(model="tiny", prompt=PROMPT, extra_body={"min_p": 2.0})
    assert "SamplingParams.min_p must be in [0, 1], got 2.0" in err.value.message


async def test_logprobs_equal_teacher_forced_logprobs(
    oai: openai.AsyncOpenAI, client: LocalTrainingClient
) -> None:
    out = await oai.completions.create(
        model="tiny", prompt="hello ", seed=3, max_tokens=12, logprobs=0, temperature=1.0
    )
    prompt = out.model_extra["prompt_token_ids"]  # pyright: ignore[reportOptionalSubscript]
    tokens = out.choices[0].model_extra["token_ids"]  # pyright: ignore[reportOptionalSubscript]
    forced = await in_process(client).compute_logprobs(prompt + tokens)
    sampled = out.choices[0].logprobs.token_logprobs  # pyright: ignore[reportOptionalMemberAccess]
    # KV-cached decoding vs one full forward in float32: summation order differs; measured
    # differences measured at most 4.8e-7 on this model; 1e-5 still catches any real mismatch
    # (a wrong position or temperature moves a logprob by >1e-2).
    assert sampled == pytest.approx(forced[len(prompt) :], abs=1e-5)


async def test_chat_completion_equals_in_process_sampling(
    oai: openai.AsyncOpenAI, client: LocalTrainingClient
) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    out = await oai.chat.completions.create(
        model="tiny",
        messages=messages,
        n=2,
        seed=11,
        max_tokens=5,
        logprobs=True,
    )
    tokenizer = tokenizer_of(client)
    rendered = tokenizer.apply_chat_template(
        [dict(m) for m in messages],  # pyright: ignore[reportArgumentType]
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    prompt = [int(t) for t in rendered]  # pyright: ignore[reportArgumentType]
    assert out.object == "chat.completion"
    assert out.model_extra is not None and out.model_extra["prompt_token_ids"] == list(prompt)
    expected = await in_process(client).sample(prompt, 2, SamplingParams(max_tokens=5, seed=11))
    for choice, sequence in zip(out.choices, expected.sequences, strict=True):
        assert choice.model_extra is not None and choice.model_extra["token_ids"] == sequence.tokens
        assert choice.message.role == "assistant"
        assert choice.message.content == tokenizer.decode(sequence.tokens, skip_special_tokens=True)
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert [e.logprob for e in choice.logprobs.content] == sequence.logprobs
        assert all(e.top_logprobs == [] for e in choice.logprobs.content)
        assert choice.finish_reason == "length"
    # Text content parts are joined into the message's text.
    parts = await oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        seed=11,
        max_tokens=5,
    )
    plain = await oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], seed=11, max_tokens=5
    )
    assert parts.choices[0].model_extra == plain.choices[0].model_extra
    assert plain.choices[0].logprobs is None


async def test_seed_reproducible_and_concurrent_requests_independent(
    oai: openai.AsyncOpenAI,
) -> None:
    async def tokens(seed: int) -> list[list[int]]:
        out = await oai.completions.create(
            model="tiny", prompt=PROMPT, n=2, seed=seed, max_tokens=8
        )
        return [c.model_extra["token_ids"] for c in out.choices]  # pyright: ignore[reportOptionalSubscript]

    first = await tokens(5)
    assert await tokens(5) == first
    assert await tokens(6) != first
    # Requests in flight together are queued on the client's one thread: same answers.
    together = await asyncio.gather(*(tokens(s) for s in (5, 6, 5, 6)))
    assert together[0] == together[2] == first and together[1] == together[3]


async def test_stop_string_cut_from_text_kept_in_token_ids(
    oai: openai.AsyncOpenAI, client: LocalTrainingClient
) -> None:
    tokenizer = tokenizer_of(client)
    free = await oai.completions.create(model="tiny", prompt=PROMPT, seed=1, max_tokens=40)
    free_tokens = free.choices[0].model_extra["token_ids"]  # pyright: ignore[reportOptionalSubscript]
    # A printable character the model samples mid-way serves as the stop string.
    at = next(
        i
        for i in range(3, 40)
        if 33 <= free_tokens[i] < 127 and free_tokens[i] not in free_tokens[:i]
    )
    stop = chr(free_tokens[at])
    out = await oai.completions.create(
        model="tiny", prompt=PROMPT, seed=1, max_tokens=40, stop=[stop, "never-sampled"]
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["token_ids"] == free_tokens[: at + 1]  # pyright: ignore[reportOptionalSubscript]
    assert choice.text == tokenizer.decode(free_tokens[:at], skip_special_tokens=True)
    assert stop not in choice.text


async def test_eos_still_stops_when_stop_strings_are_given(
    oai: openai.AsyncOpenAI, client: LocalTrainingClient
) -> None:
    eos = tokenizer_of(client).eos_token_id
    params = SamplingParams(max_tokens=200, seed=0)
    free = await in_process(client).sample(PROMPT, 16, params)
    index, ended = next((j, s) for j, s in enumerate(free.sequences) if s.tokens[-1] == eos)
    out = await oai.completions.create(
        model="tiny", prompt=PROMPT, n=16, seed=0, max_tokens=200, stop="@@never@@"
    )
    choice = out.choices[index]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["token_ids"] == ended.tokens  # pyright: ignore[reportOptionalSubscript]


async def test_bad_requests_name_the_field(oai: openai.AsyncOpenAI) -> None:
    cases = [
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"logprobs": 2}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, 99999]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"echo": True}, "echo"),
    ]
    for fields, param in cases:
        body = {"prompt": PROMPT, **fields}
        with pytest.raises(openai.BadRequestError) as err:
            await oai.completions.create(model="tiny", **body)
        assert err.value.status_code == 400 and err.value.param == param, fields
        assert err.value.type == "invalid_request_error" and param in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        await oai.completions.create(model="tiny", prompt=PROMPT, stream=True)
    assert "stream" in err.value.message and err.value.param == "stream"
    with pytest.raises(openai.BadRequestError) as err:
        await oai.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=2
        )
    assert err.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as err:
        await oai.chat.completions.create(model="tiny", messages=[])
    assert err.value.param == "messages"


async def test_raw_http_errors_have_openai_shape(url: str) -> None:
    headers = {"authorization": "Bearer alice", "content-type": "application/json"}
    async with httpx.AsyncClient(base_url=url) as http:
        bad_json = await http.post("/v1/completions", content=b"{not json", headers=headers)
        unknown = await http.post(
            "/v1/chat/completions",
            json={"model": "nope", "messages": [{"role": "user", "content": "x"}]},
            headers=headers,
        )
    assert bad_json.status_code == 400
    assert set(bad_json.json()["error"]) == {"message", "type", "param", "code"}
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"
