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

from posttrain.engine.tiny import CHAT_TEMPLATE, build_tokenizer

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
