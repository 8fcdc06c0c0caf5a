"""OpenAI-compatible sampling over a `SamplerSource`: /v1/models, /v1/completions, /v1/chat/completions.

Responses have OpenAI's shapes plus vLLM's token-id extension fields, always present:
`prompt_token_ids` on the response and on each choice (vLLM puts them on a completion's
choices and on a chat response; a chat choice carries them here too, so a choice alone builds
a trajectory: `posttrain.data.openai_choices`), and `token_ids` on each choice. `token_ids` are the
exact tokens sampled, EOS or the tokens that completed a stop string included, so rollout code
builds trajectories on them, never on re-tokenized text. Logprobs are the sampler's, aligned
with `token_ids` (returned when asked, or with `return_token_ids`):
log_softmax(logits / temperature) of each sampled token over the full vocabulary (see
`posttrain.engine.decode.sampler`). Stop strings end generation as OpenAI's do (besides EOS) and are
cut from `text` / `message.content`, never from `token_ids`.

Concurrent requests for a model are sampled together in batched calls
(`posttrain.server.sample_batching`). With `tools`, Hermes-style tool calls in the text become
the message's `tool_calls` (`posttrain.server.tool_calls`). Nothing blocks the event loop: `SamplerSource.sampler` may load a checkpoint, so it runs in a
worker thread (sources are thread-safe), and `ModelSampler` calls return futures completed by
the training client's own worker thread, which the handlers await.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from jinja2 import TemplateError
from pydantic import BaseModel
from typing_extensions import TypeIs

from posttrain.inference.model_sampler import ModelSampler
from posttrain.rollouts.tool_calls import openai_tool_calls
from posttrain.server.fair_queue import as_tenant
from posttrain.server.openai_schema import (
    ChatRequest,
    CompletionRequest,
    OpenAIError,
    chat_logprobs,
    completion_text,
    eos_texts,
    legacy_logprobs,
    parse_request,
    sampling_params,
    usage,
    user_stops,
)
from posttrain.server.sample_batching import Batchers
from posttrain.server.sources import SamplerSource, SourceBusyError, UnknownModelError
from posttrain.tokenizer import Tokenizer, as_tokenizer
from posttrain.types import SampleResponse, SamplingParams

log = logging.getLogger(__name__)

# OpenAI's default for /v1/completions; chat completions default to "until EOS or context end".
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Arguments of apply_chat_template that the request sets by its own fields.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "tools", "tokenize", "return_dict", "add_generation_prompt"}
)

Json = dict[str, object]


def create_openai_router(source: SamplerSource) -> APIRouter:
    """The three endpoints; the caller's identity is `request.state.owner` (None without keys)."""
    router = APIRouter()
    batchers = Batchers()

    @router.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        names = source.model_names(_owner(request))
        return JSONResponse({"object": "list", "data": [_model_card(n) for n in names]})

    @router.get("/v1/models/{name:path}")
    async def retrieve_model(name: str, request: Request) -> JSONResponse:
        return await _respond(_retrieve(source, name, _owner(request)))

    # Each caller (API key) is a tenant of the compute thread, as a Tinker session is
    # (`server.fair_queue`): the contextvar reaches the threads the request uses.
    @router.post("/v1/completions", openapi_extra=_request_body(CompletionRequest))
    async def completions(request: Request) -> JSONResponse:
        with as_tenant(f"owner:{_owner(request)}"):
            return await _respond(_completion(source, batchers, request))

    @router.post("/v1/chat/completions", openapi_extra=_request_body(ChatRequest))
    async def chat_completions(request: Request) -> JSONResponse:
        with as_tenant(f"owner:{_owner(request)}"):
            return await _respond(_chat(source, batchers, request))

    return router


def _request_body(model: type[BaseModel]) -> dict[str, object]:
    """The OpenAPI request body of a route that parses its own JSON (to answer in OpenAI's
    error shape), so the spec, and the fuzz test built on it, still know the fields."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: object) -> object:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(value) for value in node]
        return node

    content = {"application/json": {"schema": inline(schema)}}
    return {"requestBody": {"required": True, "content": content}}


async def _respond(answer: Awaitable[Json]) -> JSONResponse:
    try:
        return JSONResponse(await answer)
    except OpenAIError as exc:
        return JSONResponse(exc.body(), status_code=exc.status)
    except Exception:
        log.exception("OpenAI-compatible request failed")
        error = OpenAIError(500, "internal error while sampling", kind="server_error")
        return JSONResponse(error.body(), status_code=500)


def _owner(request: Request) -> str | None:
    # `request.state` is `scope["state"]`; read directly, as a missing attribute of State
    # raises (and is caught) on every request without keys.
    state = request.scope.get("state")
    return state.get("owner") if isinstance(state, dict) else None


def _model_card(name: str) -> Json:
    return {"id": name, "object": "model", "created": 0, "owned_by": "posttrain"}


async def _retrieve(source: SamplerSource, name: str, owner: str | None) -> Json:
    await _sampler(source, name, owner)
    return _model_card(name)


async def _body(request: Request) -> object:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise OpenAIError(400, "the request body is not valid JSON") from None
    except RecursionError:  # the parser recurses once per level of nesting
        raise OpenAIError(
            400, "the request body nests too deeply to parse; no OpenAI request does that"
        ) from None


async def _sampler(source: SamplerSource, name: str, owner: str | None) -> ModelSampler:
    try:
        # A source that never blocks (LocalModelSource: its models are loaded) is asked on
        # the event loop; one that may load a checkpoint, from a worker thread.
        if getattr(source, "never_blocks", False):
            return source.sampler(name, owner)
        return await asyncio.to_thread(source.sampler, name, owner)
    except SourceBusyError as exc:
        raise OpenAIError(503, str(exc), kind="server_error") from None
    except UnknownModelError:
        served = ", ".join(source.model_names(owner)) or "(none)"
        raise OpenAIError(
            404,
            f"model {name!r} does not exist; served models: {served}",
            param="model",
            code="model_not_found",
        ) from None


async def _sample(
    batchers: Batchers,
    sampler: ModelSampler,
    prompt: list[int],
    n: int,
    params: SamplingParams,
    param: str,
) -> SampleResponse:
    if not prompt:
        raise OpenAIError(400, f"{param} is empty: it renders to no tokens", param=param)
    try:
        return await batchers.of(sampler).sample(sampler, prompt, n, params)
    except ValueError as exc:  # the sampler's checks: token ids out of range, prompt too long
        raise OpenAIError(400, str(exc), param=param) from None


async def _completion(source: SamplerSource, batchers: Batchers, request: Request) -> Json:
    req = parse_request(await _body(request), CompletionRequest)
    if req.logprobs:
        raise OpenAIError(
            400,
            f"logprobs={req.logprobs} asks for the top {req.logprobs} alternative tokens, which "
            "this server does not compute; send logprobs=0 for the sampled tokens' logprobs",
            param="logprobs",
        )
    sampler = await _sampler(source, req.model, _owner(request))
    tokenizer = as_tokenizer(sampler.tokenizer)
    prompt = _completion_prompt(tokenizer, req.prompt)
    max_tokens = req.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
    params = sampling_params(req, max_tokens, eos_texts(tokenizer))
    response = await _sample(batchers, sampler, prompt, req.n, params, "prompt")
    as_ids = bool(req.return_tokens_as_token_ids)
    choices: list[Json] = []
    for index, sequence in enumerate(response.sequences):
        text, finish = completion_text(tokenizer, sequence, user_stops(req))
        logprobs = legacy_logprobs(tokenizer, sequence, as_ids) if req.wants_logprobs() else None
        choices.append(
            {
                "index": index,
                "text": text,
                "finish_reason": finish,
                "logprobs": logprobs,
                "prompt_token_ids": prompt,
                "token_ids": list(sequence.tokens),
            }
        )
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": choices,
        "usage": usage(len(prompt), response.sequences),
        "prompt_token_ids": prompt,
    }


def _completion_prompt(
    tokenizer: Tokenizer, prompt: str | list[int] | list[str] | list[list[int]]
) -> list[int]:
    """A string (tokenized with the tokenizer's special tokens, as vLLM does) or token ids."""
    if isinstance(prompt, str):
        return [int(t) for t in tokenizer.encode(prompt)]
    if _token_ids(prompt):
        return [int(t) for t in prompt]
    if len(prompt) != 1:
        raise OpenAIError(
            400,
            "batched prompts are not supported: send one prompt per request",
            param="prompt",
        )
    return _completion_prompt(tokenizer, prompt[0])


def _token_ids(prompt: list[int] | list[str] | list[list[int]]) -> TypeIs[list[int]]:
    """Whether a list prompt is one prompt's token ids, not a batch (the request's schema
    made each list hold one kind of item)."""
    return not prompt or isinstance(prompt[0], int)


async def _chat(source: SamplerSource, batchers: Batchers, request: Request) -> Json:
    req = parse_request(await _body(request), ChatRequest)
    if req.top_logprobs:
        raise OpenAIError(
            400,
            f"top_logprobs={req.top_logprobs} is not supported: this server returns only the "
            "sampled tokens' logprobs; send top_logprobs=0 or leave it out",
            param="top_logprobs",
        )
    sampler = await _sampler(source, req.model, _owner(request))
    tokenizer = as_tokenizer(sampler.tokenizer)
    prompt = _chat_prompt(tokenizer, req)
    max_tokens = req.max_completion_tokens or req.max_tokens
    params = sampling_params(req, max_tokens, eos_texts(tokenizer))
    response = await _sample(batchers, sampler, prompt, req.n, params, "messages")
    as_ids = bool(req.return_tokens_as_token_ids)
    choices: list[Json] = []
    for index, sequence in enumerate(response.sequences):
        text, finish = completion_text(tokenizer, sequence, user_stops(req))
        message, finish_reason = _message(text, finish, req.parses_tool_calls())
        choices.append(
            {
                "index": index,
                "message": message,
                "finish_reason": finish_reason,
                "logprobs": chat_logprobs(tokenizer, sequence, as_ids)
                if req.wants_logprobs()
                else None,
                "prompt_token_ids": prompt,
                "token_ids": list(sequence.tokens),
            }
        )
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": choices,
        "usage": usage(len(prompt), response.sequences),
        "prompt_token_ids": prompt,
    }


def _message(text: str, finish: str, tools: bool) -> tuple[Json, str]:
    """The choice's assistant message and finish_reason; with tools, the text's tool calls."""
    message: Json = {"role": "assistant", "content": text, "refusal": None}
    if not tools:
        return message, finish
    content, calls = openai_tool_calls(text)
    if not calls:
        return message, finish
    message.update(content=content, tool_calls=calls)
    return message, "tool_calls" if finish == "stop" else finish


def _chat_prompt(tokenizer: Tokenizer, req: ChatRequest) -> list[int]:
    """The conversation rendered by the model's chat template, with the generation prompt (and
    the request's tools and chat_template_kwargs)."""
    extra: dict[str, Any] = dict(req.chat_template_kwargs or {})  # template variables: any JSON
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & extra.keys())
    if reserved:
        raise OpenAIError(
            400,
            f"chat_template_kwargs may not set {', '.join(reserved)}: the request's own fields do",
            param="chat_template_kwargs",
        )
    try:
        text = tokenizer.apply_chat_template(
            [m.for_template() for m in req.messages],
            tools=[tool.model_dump() for tool in req.tools] if req.tools else None,
            add_generation_prompt=True,
            tokenize=False,
            **extra,
        )
    except (ValueError, TypeError, TemplateError) as exc:
        raise OpenAIError(
            400, f"the model's chat template cannot render messages: {exc}", param="messages"
        ) from None
    if not isinstance(text, str):
        raise TypeError(
            f"apply_chat_template(tokenize=False) returned a {type(text).__name__}, not the text"
        )
    return encode_rendered(tokenizer, text)


def encode_rendered(tokenizer: Tokenizer, text: str) -> list[int]:
    """What `apply_chat_template(tokenize=True)` gives for the rendered `text`: its tokens
    without added special tokens. A fast tokenizer's Rust backend is called directly: the
    Python wrapper costs more than the encoding, on every request."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return list(backend.encode(text, add_special_tokens=False).ids)
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
