"""A data file of preferences -> `PreferencePair`s on exact tokens, for `backend.train_dpo`.

Each line is `{"prompt": "...", "chosen": "...", "rejected": "..."}` (the prompt a user turn)
or `{"messages": [...], "chosen": "...", "rejected": "..."}` (the conversation before the
answers); the answers become assistant turns rendered by the chat template
(`preference_pair_from_chat`, below). The file is JSONL or any format of
`posttrain.data.rows`. Errors name the file and the row (a JSONL file's line).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from posttrain.data.preferences import PreferencePair
from posttrain.data.rows import open_rows
from posttrain.rollouts.sft_data import ROLES
from posttrain.tokenizer import Tokenizer, TurnClosing, assistant_closing, render_chat


def load_preference_pairs(
    path: str | Path, tokenizer: Tokenizer, *, split: str | None = None
) -> list[PreferencePair]:
    """One pair per row of the data at `path`: a JSONL file, or any source
    `posttrain.data.rows.open_rows` reads (a DatasetDict's `split`, or `DIR@SPLIT`)."""
    rows = open_rows(path, split=split, what="DPO dataset")
    closing = assistant_closing(tokenizer)
    pairs: list[PreferencePair] = []
    for index, record in rows.records():
        try:
            prompt, chosen, rejected = _preference(record)
            pairs.append(
                preference_pair_from_chat(tokenizer, prompt, chosen, rejected, closing=closing)
            )
        except ValueError as exc:
            raise ValueError(f"{rows.where(index)}: {exc}") from None
    if not pairs:
        raise ValueError(f"DPO dataset {rows.source!r} has no pairs")
    return pairs


def _preference(record: dict[str, Any]) -> tuple[list[dict[str, str]], str, str]:
    for name in ("chosen", "rejected"):
        if not isinstance(record.get(name), str):
            raise ValueError(f"field {name!r} must be a string, got {record.get(name)!r}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("field 'messages' must be a non-empty list of messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise ValueError(
                    f"messages[{i}] must be {{'role': ..., 'content': str}}, got {m!r}"
                )
            if not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] must have string content, got {m!r}")
        prompt = [dict(m) for m in messages]
    elif isinstance(record.get("prompt"), str):
        prompt = [{"role": "user", "content": record["prompt"]}]
    else:
        raise ValueError("needs a string field 'prompt' or a list 'messages' before the answers")
    return prompt, record["chosen"], record["rejected"]


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
        if not isinstance(text, str) or not text:
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
