"""Tool calls written in an assistant's text, Qwen/Hermes style, and the messages that answer them.

One parser for the environments (which tell the model what is wrong with a call) and for the
OpenAI-compatible endpoints (which return a reply's calls as `tool_calls`, through
`openai_tool_calls`). A call is `<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>`
anywhere in the text. Parsing never raises: a call whose JSON does not parse, that lacks a
name or whose arguments are not an object, or that is never closed (a turn cut by max_tokens)
is returned with `error` saying what is wrong, so the environment can tell the model.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)(" + re.escape(CLOSE) + r"|$)", re.S)


@dataclass(frozen=True)
class ToolCall:
    """One call as written: `raw` is the text between the tags; `error` is None when the call
    is well formed (then `name` and `arguments` are set)."""

    id: str
    raw: str
    name: str | None = None
    arguments: Mapping[str, object] = field(default_factory=dict[str, object])
    error: str | None = None

    def as_message_entry(self) -> dict[str, object]:
        """The call as an assistant message's `tool_calls` entry (OpenAI's shape, arguments as
        an object as chat templates take them; the raw text when they did not parse)."""
        arguments: object = dict(self.arguments) if self.error is None else self.raw
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name or "", "arguments": arguments},
        }


def call_id(index: int) -> str:
    """The id of an episode's `index`-th call: nine letters and digits, as the strictest chat
    templates (Mistral's) require."""
    return f"call{index:05d}"


def parse_tool_calls(text: str, first_index: int = 0) -> tuple[str, list[ToolCall]]:
    """(the text outside the calls, the calls in order); ids count from `first_index`."""
    calls: list[ToolCall] = []
    for i, match in enumerate(_CALL.finditer(text)):
        raw, closed = match.group(1), bool(match.group(2))
        calls.append(_parse_one(call_id(first_index + i), raw.strip(), closed))
    return _CALL.sub("", text).strip(), calls


def _parse_one(id_: str, raw: str, closed: bool) -> ToolCall:
    if not closed:
        return ToolCall(id_, raw, error=f"the call is not closed with {CLOSE}")
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        return ToolCall(id_, raw, error=f"the call is not valid JSON ({exc.msg})")
    if not isinstance(body, dict):
        return ToolCall(
            id_, raw, error='the call must be a JSON object {"name": ..., "arguments": {...}}'
        )
    name, arguments = body.get("name"), body.get("arguments", {})
    if not isinstance(name, str) or not name:
        return ToolCall(id_, raw, error='the call has no "name"')
    if not isinstance(arguments, dict):
        return ToolCall(id_, raw, name=name, error='"arguments" must be a JSON object')
    return ToolCall(id_, raw, name=name, arguments=arguments)


def assistant_message(content: str, calls: Sequence[ToolCall]) -> dict[str, object]:
    """The assistant message with its calls as `tool_calls` (none: content only)."""
    message: dict[str, object] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [call.as_message_entry() for call in calls]
    return message


def tool_message(call: ToolCall, content: str) -> dict[str, str]:
    """The result of `call` (or what was wrong with it), as a `tool` message."""
    return {"role": "tool", "tool_call_id": call.id, "name": call.name or "", "content": content}


def openai_tool_calls(text: str) -> tuple[str | None, list[dict[str, object]]]:
    """(content, tool calls) of a completion's text as the OpenAI API returns them, for an
    endpoint whose request gave `tools`; (text, []) when it calls no tool.

    If any call is malformed the whole text stays content, with no tool calls: the model's
    output is returned as it is, never half parsed (token ids are never touched). The text
    before the first call is the message's content; ids are random, as OpenAI's are."""
    _, calls = parse_tool_calls(text)
    if not calls or any(call.error is not None for call in calls):
        return text, []
    entries: list[dict[str, object]] = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            # OpenAI sends arguments as a JSON string.
            "function": {"name": call.name, "arguments": json.dumps(dict(call.arguments))},
        }
        for call in calls
    ]
    content = text[: text.index(OPEN)]
    return (content if content.strip() else None), entries
