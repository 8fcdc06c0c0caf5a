"""Chat templates on posttrain's byte tokenizer that close an assistant turn differently.

Each differs from the tiny template only in what follows an assistant message's content, so
expected tokens can be written by hand (one token per character):
- "tiny": the end-of-turn token alone, `<|eos|>`;
- "qwen": the end-of-turn token, then a newline (Qwen's `<|im_end|>\\n`);
- "llama2": a space, then the end-of-turn token (Llama 2's `content.strip() + ' ' + eos`).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerFast

from posttrain.models.tiny import CHAT_TEMPLATE, build_tokenizer

CONTENT = "message['content'] + eos_token -}}"
assert CONTENT in CHAT_TEMPLATE  # else the variants below would silently be the tiny one
TEMPLATES = {
    "tiny": CHAT_TEMPLATE,
    "qwen": CHAT_TEMPLATE.replace(CONTENT, "message['content'] + eos_token + '\\n' -}}"),
    "llama2": CHAT_TEMPLATE.replace(
        CONTENT,
        "(message['content'] | trim + ' ' if message['role'] == 'assistant' "
        "else message['content']) + eos_token -}}",
    ),
}
# What each puts before and after the end-of-turn token of an assistant turn.
BEFORE_END = {"tiny": (), "qwen": (), "llama2": (ord(" "),)}
AFTER_END = {"tiny": (), "qwen": (ord("\n"),), "llama2": ()}


@dataclass(frozen=True)
class Template:
    name: str
    tokenizer: PreTrainedTokenizerFast
    before_end: tuple[int, ...]
    after_end: tuple[int, ...]


def template(name: str) -> Template:
    """The byte tokenizer with template `name`."""
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TEMPLATES[name]
    return Template(name, tokenizer, BEFORE_END[name], AFTER_END[name])


# Qwen 2.5's way with tools, on the byte tokenizer (EOS for `<|im_end|>`): the tools listed in
# the system turn, an assistant's `tool_calls` rendered as `<tool_call>` JSON after its content,
# and consecutive tool results gathered in one user turn of `<tool_response>`s.
TOOLS_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\\n' -}}{%- endif -%}"
    "{{- '# Tools' -}}{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- eos_token + '\\n' -}}"
    "{%- elif messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0].content + eos_token + '\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'system' and loop.first -%}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') -}}"
    "{%- for call in message.tool_calls or [] -%}"
    "{{- '<tool_call>\\n' + ({'name': call.function.name, 'arguments': call.function.arguments}"
    " | tojson) + '\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- eos_token + '\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}"
    "{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}"
    "{{- eos_token + '\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + eos_token + '\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def tools_tokenizer() -> PreTrainedTokenizerFast:
    """The byte tokenizer with TOOLS_TEMPLATE."""
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE
    return tokenizer
