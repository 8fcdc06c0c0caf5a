"""Requests and responses of the OpenAI-compatible endpoints, as plain validation and builders.

Requests are validated here (pydantic, field named in every error) and turned into posttrain
`SamplingParams`; `SampledSequence`s are turned into OpenAI's choice shapes. Nothing here does
I/O, so `openai_api` stays a thin router.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from posttrain.inference.engines import DISTRIBUTION_FIELDS
from posttrain.server.tinker_schema import (
    MAX_SAMPLE_TOKENS,
    TOKEN_ID_LIMIT,
    Seed,
    TokenId,
    unencodable_text,
)
from posttrain.tokenizer import Tokenizer, end_of_turn_id, eos_token
from posttrain.types import SampledSequence, SamplingParams

MAX_N = 128

ErrorType = Literal["invalid_request_error", "not_found_error", "server_error"]


class OpenAIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: ErrorType = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status,
            message,
            param,
            code,
            kind,
        )

    def body(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


class _SamplingFields(BaseModel):
    """Fields both endpoints share; unknown fields are ignored.

    vLLM's extensions: `top_k`, `min_p`, `repetition_penalty`; `return_token_ids` (token ids are always returned; asking for
    them also turns on the sampled tokens' logprobs unless `logprobs` is given, as ART's
    server does: a trajectory needs both); `return_tokens_as_token_ids` (logprob tokens as
    "token_id:<id>"); `include_stop_str_in_output` (keep the stop string in the text, so the
    text re-renders to the sampled tokens).
    """

    # Extra fields are kept: those of SamplingParams that shape the distribution (OpenAI's
    # presence_penalty and frequency_penalty, vLLM's min_p and repetition_penalty, and any
    # added later) are read from them; the rest are ignored.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, lt=TOKEN_ID_LIMIT)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_SAMPLE_TOKENS)
    stop: str | list[str] | None = None
    seed: Seed | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    include_stop_str_in_output: bool = False


class CompletionRequest(_SamplingFields):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: int | None = Field(default=None, ge=0, le=5)

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None or bool(self.return_token_ids)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None

    def for_template(self) -> dict[str, object]:
        """The message as a chat template reads it: text parts joined, extra keys kept, tool
        call arguments as objects (OpenAI sends them as JSON strings; templates such as Qwen's
        render them with `tojson`, as vLLM gives them)."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        extra = dict(self.model_extra or {})
        if isinstance(extra.get("tool_calls"), list):
            extra["tool_calls"] = [_call_for_template(call) for call in extra["tool_calls"]]
        return {**extra, "role": self.role, "content": content or ""}


def _call_for_template(call: object) -> object:
    if not isinstance(call, dict):
        return call
    function = call.get("function")
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return call  # not JSON: the template gets the string as it is
    return {**call, "function": {**function, "arguments": parsed}}


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)


class ToolSpec(BaseModel):
    """A tool the model may call: given to the chat template (`tools=`), as OpenAI sends it."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: FunctionSpec


class ChatRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_SAMPLE_TOKENS)
    tools: list[ToolSpec] | None = None
    # "auto" (the default with tools): the model decides; "none": no tool call is parsed.
    tool_choice: Literal["auto", "none"] | None = None
    chat_template_kwargs: dict[str, object] | None = None

    def wants_logprobs(self) -> bool:
        return bool(self.logprobs) if self.logprobs is not None else bool(self.return_token_ids)

    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


# OpenAI fields this server does not implement. Each is accepted only at a value that asks for
# nothing, so no request is silently served differently from what it asked.
_INERT: dict[str, Callable[[object], bool]] = {
    "stream": lambda v: v is None or v is False,
    "echo": lambda v: v is None or v is False,
    "suffix": lambda v: v is None or v == "",
    "best_of": lambda v: v is None or v == 1,
    "logit_bias": lambda v: not v,
    "functions": lambda v: not v,
    "response_format": lambda v: v is None or v == {"type": "text"},
}

RequestT = TypeVar("RequestT", bound=_SamplingFields)


def parse_request(body: object, kind: type[RequestT]) -> RequestT:
    """Validate a JSON body; OpenAIError(400) naming the field on any problem."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    for name, value in body.items():
        where = unencodable_text({name: value})
        if where is not None:
            raise OpenAIError(
                400,
                f"invalid {where}: it holds a lone UTF-16 surrogate (such as \\ud800), which is "
                "not text; send valid Unicode",
                param=None if where.startswith("a key of") else name,
            )
    for name, inert in _INERT.items():
        if name in body and not inert(body[name]):
            hint = " (streaming is not supported; send stream=false)" if name == "stream" else ""
            raise OpenAIError(
                400,
                f"{name}={json.dumps(body[name])} is not supported by this server{hint}",
                param=name,
            )
    try:
        return kind.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(part) for part in first["loc"]]
        raise OpenAIError(
            400, f"invalid {'.'.join(loc) or 'body'}: {first['msg']}", param=loc[0] if loc else None
        ) from None


def sampling_params(
    request: _SamplingFields, max_tokens: int | None, eos_texts: Sequence[str]
) -> SamplingParams:
    """posttrain SamplingParams for `request`.

    OpenAI's stop strings end generation in addition to EOS, while posttrain's explicit `stop`
    replaces EOS; so with stop strings, the EOS tokens' texts join them (the sampler matches
    stop strings on text decoded with special tokens).
    """
    stop: tuple[str, ...] | None = None
    if request.stop:
        user = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop)
        if any(not s for s in user):
            raise OpenAIError(400, "invalid stop: stop strings must not be empty", param="stop")
        stop = (*user, *eos_texts)
    extra = request.model_extra or {}
    shaping = {k: extra[k] for k in DISTRIBUTION_FIELDS if extra.get(k) is not None}
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            seed=request.seed,
            stop=stop,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_k=-1 if request.top_k is None else request.top_k,
            top_p=1.0 if request.top_p is None else request.top_p,
            **shaping,
        )
    except ValueError as exc:
        raise OpenAIError(400, str(exc)) from None


def eos_texts(tokenizer: Tokenizer) -> tuple[str, ...]:
    """The texts of what the sampler stops on by default: EOS and the chat template's end of
    turn, where that is another token."""
    texts = [eos] if (eos := eos_token(tokenizer)) else []
    end = end_of_turn_id(tokenizer)
    if end is not None:
        texts.append(str(tokenizer.decode([end], skip_special_tokens=False)))
    return tuple(dict.fromkeys(texts))


def user_stops(request: _SamplingFields) -> tuple[str, ...]:
    """The stop strings to cut from the text (none with `include_stop_str_in_output`)."""
    if not request.stop or request.include_stop_str_in_output:
        return ()
    return (request.stop,) if isinstance(request.stop, str) else tuple(request.stop)


def completion_text(
    tokenizer: Tokenizer, sequence: SampledSequence, stops: Sequence[str]
) -> tuple[str, Literal["stop", "length"]]:
    """The choice's text (ending before the first stop string, as OpenAI's) and finish_reason."""
    text = str(tokenizer.decode(sequence.tokens, skip_special_tokens=True))
    if sequence.stop_reason == "stop" and stops:
        cut = min((i for s in stops if (i := text.find(s)) >= 0), default=len(text))
        text = text[:cut]
    return text, sequence.stop_reason


def _logprobs_of(sequence: SampledSequence) -> list[float]:
    if sequence.logprobs is None:
        raise OpenAIError(500, "the sampler returned no logprobs", kind="server_error")
    return list(sequence.logprobs)


def token_texts(tokenizer: Tokenizer, tokens: Sequence[int], as_ids: bool = False) -> list[str]:
    """Each token's text, or "token_id:<id>" (vLLM's `return_tokens_as_token_ids`)."""
    if as_ids:
        return [f"token_id:{t}" for t in tokens]
    decode = tokenizer.decode
    return [str(decode([t], skip_special_tokens=False)) for t in tokens]


def legacy_logprobs(
    tokenizer: Tokenizer, sequence: SampledSequence, as_ids: bool = False
) -> dict[str, object]:
    """The /v1/completions `logprobs` object for the sampled tokens (no top alternatives)."""
    texts = token_texts(tokenizer, sequence.tokens, as_ids)
    offsets, offset = [], 0
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": texts,
        "token_logprobs": _logprobs_of(sequence),
        "top_logprobs": None,
        "text_offset": offsets,
    }


def chat_logprobs(
    tokenizer: Tokenizer, sequence: SampledSequence, as_ids: bool = False
) -> dict[str, object]:
    """The /v1/chat/completions `logprobs` object: one entry per sampled token."""
    texts = token_texts(tokenizer, sequence.tokens, as_ids)
    return {
        "content": [
            # `bytes` is optional in OpenAI's shape; a per-token decode cannot give a split
            # character's bytes faithfully, so it is left out rather than made up.
            {"token": text, "logprob": logprob, "bytes": None, "top_logprobs": []}
            for text, logprob in zip(texts, _logprobs_of(sequence), strict=True)
        ],
        "refusal": None,
    }


def usage(prompt_tokens: int, sequences: Sequence[SampledSequence]) -> Mapping[str, int]:
    completion = sum(len(s.tokens) for s in sequences)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }
