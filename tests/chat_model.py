"""A tiny model that chats in text that re-renders to its own tokens, and calls a tool.

A freshly initialised tiny model samples arbitrary bytes; decoded, an invalid UTF-8 byte
becomes U+FFFD, which the next request's chat template renders as other tokens, so a second
turn's prompt would not extend the first (rightly refused). 200 full fine-tuning steps on two
kinds of conversations make the model answer in lowercase letters, and answer "add" (given
the tool) with a Hermes tool call, greedily:

    <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>

Greedy decoding is only as stable as the gap between the best token and the next. The model
used to be trained for 150 steps at lr 1e-2: too fast for 16 examples a step, the run was
chaotic, and on an AVX-512 host it ended with the tool call's first token 0.2 logits ahead of
EOS and its arguments wrong, while other hosts got it right. At lr 3e-3 every token of both
replies leads by 5.3 logits or more (seeds 0 and 1), against rounding differences between hosts
of 1e-5; `make_chat_model` checks a 1-logit lead, so a host where training went elsewhere
fails there, naming the cause.

The chat template renders tools, tool calls and tool results (as Qwen's does, shortened).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from openai.types.chat import ChatCompletionToolParam
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.models.tiny import make_tiny_model

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
        messages = tool_call_messages()
        tools = [ADD_TOOL]
    return tokenizer.apply_chat_template(  # pyright: ignore[reportAttributeAccessIssue]
        messages, tools=tools, tokenize=True, return_dict=False
    )


MIN_LEAD = 1.0  # logits: the check of the module docstring


def tool_call_messages() -> list[dict[str, object]]:
    """The tool-call conversation the model learns: a call to add, its result, the answer."""
    call = {"id": "c", "type": "function", "function": ADD_CALL}
    return [
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "five"},
    ]


def make_chat_model(directory: Path, steps: int = 200) -> Path:
    """The tiny model (seed 0) fine-tuned as above, saved with its tokenizer in `directory`."""
    source = make_tiny_model(directory.parent / f"{directory.name}-base")
    model = AutoModelForCausalLM.from_pretrained(source)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.chat_template = TOOL_TEMPLATE
    torch.manual_seed(0)
    rng = random.Random(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
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
    lead = greedy_lead(model, tokenizer)
    if lead < MIN_LEAD:
        raise RuntimeError(
            f"the chat model's tool-call conversation leads by only {lead:.2f} logits at some "
            f"token (< {MIN_LEAD}): greedy answers would depend on rounding; train it longer"
        )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def greedy_lead(model: torch.nn.Module, tokenizer: object) -> float:
    """The smallest lead of the right token over the next best, over every token of the two
    assistant replies of the tool-call conversation (teacher-forced: one forward pass)."""
    messages = tool_call_messages()
    render = tokenizer.apply_chat_template  # pyright: ignore[reportAttributeAccessIssue]
    ids = render(messages, tools=[ADD_TOOL], tokenize=True, return_dict=False)
    eos = tokenizer.eos_token_id  # pyright: ignore[reportAttributeAccessIssue]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    leads = []
    for turn in (1, 3):
        prompt = render(
            messages[:turn],
            tools=[ADD_TOOL],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for pos in range(len(prompt), ids.index(eos, len(prompt)) + 1):
            row = logits[pos - 1].clone()
            right = float(row[ids[pos]])
            row[ids[pos]] = float("-inf")
            leads.append(right - float(row.max()))
    return min(leads)
