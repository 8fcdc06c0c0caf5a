"""Preference pairs for DPO: a prompt with a chosen and a rejected completion, on exact tokens.

`PreferencePair` holds token ids; `preference_pair_from_chat` builds one from chat messages,
rendering them with the chat template the way `jobs.sft_data` renders an assistant turn: the
completion's tokens are what a sampler would produce for it (content, end-of-turn token), and
the prompt ends with the generation prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from posttrain.rollout import TurnClosing, assistant_closing, render_chat
from posttrain.tokenizer import Tokenizer


@dataclass(frozen=True)
class PreferencePair:
    """One prompt and two completions of it, `chosen` preferred over `rejected`."""

    prompt: tuple[int, ...]
    chosen: tuple[int, ...]
    rejected: tuple[int, ...]


def check_pairs(pairs: Sequence[PreferencePair]) -> None:
    """Raise ValueError naming the pair and field of the first bad pair (or an empty list)."""
    if not pairs:
        raise ValueError("train_dpo() got no preference pairs; pass at least one PreferencePair")
    for index, pair in enumerate(pairs):
        if not isinstance(pair, PreferencePair):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise TypeError(f"pair {index} is a {type(pair).__name__}, not a PreferencePair")
        for name in ("prompt", "chosen", "rejected"):
            if not getattr(pair, name):
                raise ValueError(f"pair {index} has an empty {name}: it needs at least one token")
        if pair.chosen == pair.rejected:
            raise ValueError(
                f"pair {index} has identical chosen and rejected completions: nothing to prefer"
            )


def preference_pair_from_chat(
    tokenizer: Tokenizer,
    prompt: Sequence[Mapping[str, object]],
    chosen: str,
    rejected: str,
    *,
    closing: TurnClosing | None = None,
) -> PreferencePair:
    """`prompt` messages rendered with the generation prompt; each answer as the assistant turn
    that follows them, through its end-of-turn token. `closing` is `assistant_closing(tokenizer)`,
    found here unless given (give it when building many pairs)."""
    if not prompt:
        raise ValueError("a preference pair needs at least one prompt message")
    for name, text in (("chosen", chosen), ("rejected", rejected)):
        if not isinstance(text, str) or not text:  # pyright: ignore[reportUnnecessaryIsInstance]
            raise ValueError(f"the {name} answer must be a non-empty string, got {text!r}")
    if chosen == rejected:
        raise ValueError("the chosen and rejected answers are identical: nothing to prefer")
    after_end = len((closing or assistant_closing(tokenizer)).after_end)
    context = render_chat(tokenizer, prompt, True)

    def completion(text: str) -> tuple[int, ...]:
        turn = render_chat(tokenizer, [*prompt, {"role": "assistant", "content": text}], False)
        if turn[: len(context)] != context:
            raise ValueError(
                "the chat template does not render the prompt as a token prefix of the prompt "
                "with its answer; it cannot give the answer's exact tokens"
            )
        return tuple(turn[len(context) : len(turn) - after_end])

    return PreferencePair(tuple(context), completion(chosen), completion(rejected))
