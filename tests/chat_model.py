"""A tiny model that chats in text that re-renders to its own tokens, and calls a tool.

A freshly initialised tiny model samples arbitrary bytes; decoded, an invalid UTF-8 byte
becomes U+FFFD, which the next request's chat template renders as other tokens, so a second
turn's prompt would not extend the first (rightly refused). A few dozen full fine-tuning
steps on two kinds of conversations make the model answer in lowercase letters, and answer
"add" (given the tool) with a Hermes tool call, greedily:

    <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>

The chat template renders tools, tool calls and tool results (as Qwen's does, shortened).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from openai.types.chat import ChatCompletionToolParam
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.engine.tiny import make_tiny_model

TOOL_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if tools -%}{{- '<|im_start|>system\\ntools: ' + (tools | map(attribute='function') "
    "| map(attribute='name') | join(',')) + eos_token -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') -}}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{{- '<tool_call>' + ({'name': call['function']['name'], 'arguments': "
    "call['function']['arguments']} | tojson) + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- eos_token -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
ADD_TOOL: ChatCompletionToolParam = {
    "type": "function",
    "function": {"name": "add", "parameters": {"type": "object"}},
}
ADD_CALL = {"name": "add", "arguments": {"a": 2, "b": 3}}


def conversations(rng: random.Random, tokenizer: object) -> list[int]:
    """One training conversation's tokens: letters echoed back, or the tool call and answer."""
    if rng.random() < 0.5:
        text = "".join(rng.choice("abcdefgh ") for _ in range(rng.randrange(4, 12)))
        messages = [
            {"role": "user", "content": text[::-1]},
            {"role": "assistant", "content": text},
        ]
        tools = None
    else:
        call = {"id": "c", "type": "function", "function": ADD_CALL}
        messages = [
            {"role": "user", "content": "add"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "5"},
            {"role": "assistant", "content": "five"},
        ]
        tools = [ADD_TOOL]
    return tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        messages, tools=tools, tokenize=True, return_dict=False
    )


def make_chat_model(directory: Path, steps: int = 150) -> Path:
    """The tiny model (seed 0) fine-tuned as above, saved with its tokenizer in `directory`."""
    source = make_tiny_model(directory.parent / f"{directory.name}-base")
    model = AutoModelForCausalLM.from_pretrained(source)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.chat_template = TOOL_TEMPLATE
    torch.manual_seed(0)
    rng = random.Random(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eos = tokenizer.eos_token_id
    for _ in range(steps):
        batch = [conversations(rng, tokenizer) for _ in range(16)]
        length = max(map(len, batch))
        ids = torch.tensor([b + [eos] * (length - len(b)) for b in batch])
        mask = torch.tensor([[1] * len(b) + [0] * (length - len(b)) for b in batch])
        loss = model(
            input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)
        ).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
