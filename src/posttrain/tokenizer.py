"""`Tokenizer`: what posttrain calls on a tokenizer. Every transformers tokenizer is one.

Its signatures are as wide as transformers' own, so that those tokenizers satisfy it
structurally: `decode` is annotated `str | list[str]` there (a batch gives a list; one
sequence, all posttrain decodes, a str), and `apply_chat_template` returns a str, token ids or a
BatchEncoding by its flags, hence `object` here and a check where it is called.
`as_tokenizer` checks a tokenizer that arrives typed `object`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeGuard

from typing_extensions import get_protocol_members

__all__ = ["Tokenizer", "as_tokenizer", "eos_token", "eos_token_id"]


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
