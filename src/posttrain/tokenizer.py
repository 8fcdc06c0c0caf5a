"""`Tokenizer`: what posttrain calls on a tokenizer. Every transformers tokenizer is one.

Its signatures are as wide as transformers' own, so that those tokenizers satisfy it
structurally: `decode` is annotated `str | list[str]` there (a batch gives a list; one
sequence, all posttrain decodes, a str), and `apply_chat_template` returns a str, token ids or a
BatchEncoding by its flags, hence `object` here and a check where it is called.
`as_tokenizer` checks a tokenizer that arrives typed `object`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeGuard

from typing_extensions import get_protocol_members

__all__ = [
    "ChatMessage",
    "Tokenizer",
    "TurnClosing",
    "as_tokenizer",
    "assistant_closing",
    "end_of_turn_id",
    "eos_token",
    "eos_token_id",
    "has_chat_template",
    "render_chat",
]

# A chat message as a chat template takes it: role and content, and for tool use an assistant's
# `tool_calls` or a tool result's `tool_call_id` and `name`.
ChatMessage = Mapping[str, object]


class Tokenizer(Protocol):
    """A tokenizer with a chat template: encode, decode, render chats."""

    @property
    def all_special_ids(self) -> list[int]: ...

    def encode(self, text: str, /, *, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(
        self, token_ids: list[int], /, *, skip_special_tokens: bool = ...
    ) -> str | list[str]: ...

    # A message's values are strings, or for tool use lists and dicts (`tool_calls`);
    # transformers annotates them as str, so only Any lets both kinds of caller through.
    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        /,
        *,
        tools: list[dict[str, Any] | Callable[..., Any]] | None = ...,
        add_generation_prompt: bool = ...,
        tokenize: bool = ...,
        return_dict: bool = ...,
        **template_kwargs: Any,
    ) -> object: ...


_MEMBERS = sorted(get_protocol_members(Tokenizer))

# transformers 5 defines the named special tokens (`eos_token`, `eos_token_id`, ...) through
# `__getattr__`, which no Protocol member can require; they are read here, where present.


def eos_token(tokenizer: Tokenizer) -> str | None:
    """The end-of-sequence token's text, if the tokenizer has one."""
    eos = getattr(tokenizer, "eos_token", None)
    return eos if isinstance(eos, str) and eos else None


def eos_token_id(tokenizer: Tokenizer) -> int | None:
    """The end-of-sequence token's id, if the tokenizer has one."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return eos if isinstance(eos, int) else None


def as_tokenizer(value: object) -> Tokenizer:
    """`value`, checked to be a Tokenizer: for a tokenizer that comes typed `object` (a
    sampling client's), so that a wrong one fails here, naming what it lacks."""
    if _is_tokenizer(value):
        return value
    missing = [m for m in _MEMBERS if not hasattr(value, m)]
    raise TypeError(
        f"a {type(value).__name__} is not a tokenizer: it has no {', '.join(missing)}; "
        "give a transformers tokenizer (AutoTokenizer.from_pretrained(...))"
    )


def _is_tokenizer(value: object) -> TypeGuard[Tokenizer]:
    return all(hasattr(value, m) for m in _MEMBERS)


@dataclass(frozen=True)
class TurnClosing:
    """What a chat template puts after an assistant message's content, cut after the
    end-of-turn token a sampler stops on: `through_end` is trained with the content (Llama 2's
    " </s>", posttrain's tiny `<|eos|>`), `after_end` is context between turns (Qwen's "\\n")."""

    through_end: tuple[int, ...]
    after_end: tuple[int, ...]

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.through_end + self.after_end


# The plain-text format, for a pretrained model whose tokenizer has no chat template (Gemma 3
# 270M, the base model): BOS, then each message's text as it is, an assistant message followed
# by EOS and a user or system message by a newline where another of them follows. No roles, no
# generation prompt: an answer continues its prompt's text ("Question: ...\nAnswer:" then
# " 12"), and the job's `[rl] stop` says where it ends ("\n" for an answer on one line).
PLAIN_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}"
    "{% elif not loop.last and loop.nextitem['role'] != 'assistant' %}{{ '\\n' }}"
    "{% endif %}{% endfor %}"
)


def has_chat_template(tokenizer: object) -> bool:
    """Whether the tokenizer brings its own chat template (else posttrain's PLAIN_TEMPLATE)."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_chat(
    tokenizer: Tokenizer,
    messages: Sequence[ChatMessage],
    generation_prompt: bool,
    *,
    tools: Sequence[Mapping[str, object]] | None = None,
) -> list[int]:
    """The chat template's token ids for `messages` (with `tools`, if any); for a tokenizer
    without a chat template, the plain-text format (`PLAIN_TEMPLATE`)."""
    plain = {} if has_chat_template(tokenizer) else {"chat_template": PLAIN_TEMPLATE}
    out = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=[dict(t) for t in tools] if tools is not None else None,
        add_generation_prompt=generation_prompt,
        tokenize=True,
        return_dict=False,
        **plain,
    )
    if not isinstance(out, list):
        raise TypeError(
            f"apply_chat_template(tokenize=True, return_dict=False) returned a "
            f"{type(out).__name__}; posttrain needs the list of token ids"
        )
    return [int(t) for t in out]


def assistant_closing(tokenizer: Tokenizer) -> TurnClosing:
    """The tokens a chat template puts after an assistant message's content, cut after the
    end-of-turn token.

    Found as the common ending of two renderings that differ only in a one-letter content:
    `<|eos|>` for posttrain's tiny template, `<|im_end|>`, `\\n` for Qwen's, " ", `</s>` for
    Llama 2's. The end-of-turn token is the first of them that is a special token of the
    tokenizer (its EOS among them); without one, the first token, as a sampler that stops on a
    plain token would.
    """
    renders = [
        render_chat(
            tokenizer,
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": c}],
            False,
        )
        for c in ("a", "b")
    ]
    common = 0
    while common < min(map(len, renders)) and renders[0][-1 - common] == renders[1][-1 - common]:
        common += 1
    closing = tuple(renders[0][len(renders[0]) - common :])
    special = {*tokenizer.all_special_ids, eos_token_id(tokenizer)}
    end = next((i for i, t in enumerate(closing) if t in special), 0)
    return TurnClosing(closing[: end + 1], closing[end + 1 :])


def end_of_turn_id(tokenizer: Tokenizer) -> int | None:
    """The special token that ends an assistant turn in the tokenizer's chat template
    (`<|im_end|>` for ChatML; EOS in the plain-text format of a tokenizer without one), or None
    where the template puts no special token there.

    Often the EOS, but not always: Qwen2.5's base models end a turn with `<|im_end|>` and name
    `<|endoftext|>` their EOS, so a sampler that stops at EOS alone writes past the answer.
    """
    try:
        closing = assistant_closing(tokenizer)
    except (ValueError, TypeError):  # no chat template, or one that cannot render this chat
        return None
    special = {*tokenizer.all_special_ids, eos_token_id(tokenizer)}
    end = closing.through_end[-1:]
    return end[0] if end and end[0] in special else None
