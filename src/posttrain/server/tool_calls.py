"""A chat completion's tool calls, in the Hermes format that Qwen's and Hermes' chat templates
teach (vLLM's `--tool-call-parser hermes`), as the OpenAI API returns them:

    some text<tool_call>
    {"name": "add", "arguments": {"a": 2, "b": 3}}
    </tool_call>

Parsed (by `posttrain.tool_calls`) only when the request gave `tools`. The text before the
first call is the message's content; if any call is malformed the whole text stays content,
with no tool calls (the model's output is returned as it is, never half parsed). Token ids are
never touched: the sampled tokens are the sampled tokens, whatever the parse.
"""

from __future__ import annotations

import json
import uuid

from posttrain.tool_calls import OPEN
from posttrain.tool_calls import parse_tool_calls as parse_calls

ToolCall = dict[str, object]


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a completion's text; (text, []) when it calls no tool."""
    _, calls = parse_calls(text)
    if not calls or any(call.error is not None for call in calls):
        return text, []
    entries: list[ToolCall] = [
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
