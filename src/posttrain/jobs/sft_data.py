"""Chat conversations -> SFT trajectories: assistant turns trainable, everything else context.

Each assistant turn's tokens are what the chat template appends to the conversation rendered
up to that turn with the generation prompt: the same tokens a sampler would produce (content,
then EOS). The template must render each prefix of a conversation as a token prefix.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from posttrain.types import TokenSegment, Trajectory

ROLES = ("system", "user", "assistant", "tool")


def render(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, str]],
    generation_prompt: bool,
) -> list[int]:
    out = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        add_generation_prompt=generation_prompt,
        tokenize=True,
        return_dict=False,
    )
    return [int(t) for t in out]  # type: ignore[union-attr]


def conversation_to_trajectory(
    messages: Sequence[Mapping[str, str]], tokenizer: PreTrainedTokenizerBase
) -> Trajectory:
    """One trajectory with every assistant turn trainable (reward 0: SFT ignores it)."""
    check_messages(messages)
    segments: list[TokenSegment] = []
    done: list[int] = []  # tokens already in segments
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        context = render(tokenizer, messages[:i], True)
        turn = render(tokenizer, messages[: i + 1], False)
        if context[: len(done)] != done or turn[: len(context)] != context:
            raise ValueError(
                "the chat template does not render this conversation's prefixes as token "
                f"prefixes (at message {i}); it cannot mark assistant turns on exact tokens"
            )
        if len(context) > len(done):
            segments.append(TokenSegment(tuple(context[len(done) :]), trainable=False))
        segments.append(TokenSegment(tuple(turn[len(context) :]), trainable=True))
        done = turn
    return Trajectory(
        segments=tuple(segments), reward=0.0, messages=tuple(dict(m) for m in messages)
    )


def check_messages(messages: object) -> None:
    """A non-empty list of {"role", "content"} strings with at least one assistant turn."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not {"role", "content"} <= set(message):
            raise ValueError(
                f"messages[{i}] must be {{'role': str, 'content': str}}, got {message!r}"
            )
        if message["role"] not in ROLES or not isinstance(message["content"], str):
            raise ValueError(
                f"messages[{i}] needs a role in {list(ROLES)} and string content, got {message!r}"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("messages has no assistant turn: nothing to train on")


def load_sft_dataset(path: str | Path, tokenizer: PreTrainedTokenizerBase) -> list[Trajectory]:
    """A JSONL file of `{"messages": [...]}` lines -> one SFT trajectory per line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"SFT dataset {str(path)!r} does not exist")
    trajectories: list[Trajectory] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or "messages" not in record:
                raise ValueError('each line must be a JSON object with a "messages" list')
            trajectories.append(conversation_to_trajectory(record["messages"], tokenizer))
        except ValueError as exc:  # json.JSONDecodeError is a ValueError too
            raise ValueError(f"{path}:{number}: {exc}") from None
    if not trajectories:
        raise ValueError(f"SFT dataset {str(path)!r} has no conversations")
    return trajectories
