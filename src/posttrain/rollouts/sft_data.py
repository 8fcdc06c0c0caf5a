"""Chat conversations -> SFT trajectories: assistant turns trainable, everything else context.

`load_sft_dataset(path)` reads a data file (JSONL, or any format of `posttrain.data.rows`)
whose rows are chats (`{"messages": [...]}`) or prompt/answer pairs (`{"prompt": "...",
"answer": "..."}`, a user turn and the assistant's answer), and returns the checked conversations; `load_sft_dataset(path, tokenizer)` returns
them as trajectories ready for `backend.train_sft` (`conversation_to_trajectory` on each).
The field names are arguments (the job passes its `[data]` table's), and `system_prompt`, when
given, goes before each conversation that has none.

Each assistant turn's trainable tokens are what a sampler would produce for it: the content,
what the template puts before the end-of-turn token (Llama 2's space) and that token, which it
stops on. Whatever the template puts after that token (Qwen's newline, say) is context, as are all other messages. The template must render each prefix of
a conversation as a token prefix. Nothing after the last assistant turn is kept: there is
nothing to train on there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias, overload

from posttrain.data.rows import open_rows
from posttrain.data.trajectories import TokenSegment, Trajectory
from posttrain.tokenizer import Tokenizer, TurnClosing, assistant_closing, render_chat

ROLES = ("system", "user", "assistant", "tool")
Conversation: TypeAlias = list[dict[str, str]]


def conversation_to_trajectory(
    messages: Sequence[Mapping[str, str]],
    tokenizer: Tokenizer,
    closing: TurnClosing | None = None,
    *,
    tools: Sequence[Mapping[str, object]] | None = None,
) -> Trajectory:
    """One trajectory with every assistant turn trainable (reward 0: SFT ignores it).

    `closing` is `assistant_closing(tokenizer)`, found here unless given: give it when
    converting many conversations. `tools` go to the chat template as in the rollouts (an
    environment's demonstrations are rendered as its episodes are).
    """
    check_messages(messages)
    # The template's tokens after the end-of-turn token are context, not something to learn.
    after_end = len((closing or assistant_closing(tokenizer)).after_end)
    segments: list[TokenSegment] = []
    done: list[int] = []  # tokens already in segments
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        context = render_chat(tokenizer, messages[:i], True, tools=tools)
        turn = render_chat(tokenizer, messages[: i + 1], False, tools=tools)
        if context[: len(done)] != done or turn[: len(context)] != context:
            raise ValueError(
                "the chat template does not render this conversation's prefixes as token "
                f"prefixes (at message {i}); it cannot mark assistant turns on exact tokens"
            )
        if len(context) > len(done):
            segments.append(TokenSegment(tuple(context[len(done) :]), trainable=False))
        end = len(turn) - after_end  # the rest goes with the next context (or is dropped)
        segments.append(TokenSegment(tuple(turn[len(context) : end]), trainable=True))
        done = turn[:end]
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


@dataclass(frozen=True)
class SFTFields:
    """Where a line keeps its chat, or its prompt and answer; and a system prompt to add."""

    messages: str = "messages"
    prompt: str = "prompt"
    answer: str = "answer"
    system_prompt: str | None = None


@overload
def load_sft_dataset(
    path: str | Path,
    tokenizer: None = None,
    *,
    fields: SFTFields = SFTFields(),
    split: str | None = None,
) -> list[Conversation]: ...


@overload
def load_sft_dataset(
    path: str | Path,
    tokenizer: Tokenizer,
    *,
    fields: SFTFields = SFTFields(),
    split: str | None = None,
) -> list[Trajectory]: ...


def load_sft_dataset(
    path: str | Path,
    tokenizer: Tokenizer | None = None,
    *,
    fields: SFTFields = SFTFields(),
    split: str | None = None,
) -> list[Conversation] | list[Trajectory]:
    """A data file of chats or prompt/answer pairs -> its conversations, checked.

    `path` is any source `posttrain.data.rows.open_rows` reads: JSONL, JSON, CSV, Parquet,
    Arrow, a `datasets.save_to_disk` directory (a DatasetDict's `split`, or `DIR@SPLIT`), or
    `hf:NAME[:CONFIG][@SPLIT]`. With a `tokenizer` (e.g.
    `backend.sampling_client(model).tokenizer`), one SFT trajectory per conversation instead,
    for `backend.train_sft`: only assistant turns are trained. Errors name the file, the row
    (the line of a JSONL file) and the field.
    """
    conversations = read_conversations(path, fields, split=split)
    if tokenizer is None:
        return [c for _, c in conversations]
    closing = assistant_closing(tokenizer)
    trajectories: list[Trajectory] = []
    for where, messages in conversations:
        try:
            trajectories.append(conversation_to_trajectory(messages, tokenizer, closing))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    return trajectories


def read_conversations(
    path: str | Path, fields: SFTFields = SFTFields(), *, split: str | None = None
) -> list[tuple[str, Conversation]]:
    """(where, messages) of each row ("file.jsonl:3", "file.parquet, row 3"), each checked by
    `check_messages`."""
    rows = open_rows(path, split=split, what="SFT dataset")
    conversations: list[tuple[str, Conversation]] = []
    for index, record in rows.records():
        try:
            messages = _conversation(record, fields, rows.unit)
            check_messages(messages)
        except ValueError as exc:
            raise ValueError(f"{rows.where(index)}: {exc}") from None
        conversations.append((rows.where(index), messages))
    if not conversations:
        raise ValueError(f"SFT dataset {rows.source!r} has no conversations")
    return conversations


def _conversation(record: dict[str, Any], fields: SFTFields, unit: str) -> Conversation:
    """One row's chat: its messages field, or a user prompt and the assistant's answer."""
    if fields.messages in record:
        messages = record[fields.messages]
        try:
            check_messages(messages)
        except ValueError as exc:
            raise ValueError(f"field {fields.messages!r}: {exc}") from None
        # Without null keys: an Arrow list of messages gives each one every key of any.
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
    elif fields.prompt in record and fields.answer in record:
        prompt, answer = record[fields.prompt], record[fields.answer]
        if isinstance(answer, int | float) and not isinstance(answer, bool):
            answer = str(answer)
        for name, value in ((fields.prompt, prompt), (fields.answer, answer)):
            if not isinstance(value, str):
                raise ValueError(f"field {name!r} must be a string, got {value!r}")
        chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    else:
        has = ", ".join(map(repr, record)) or "no fields"
        raise ValueError(
            f"no field {fields.messages!r} (a chat), nor both {fields.prompt!r} and "
            f"{fields.answer!r} (a prompt and its answer); the {unit} has {has}"
        )
    if fields.system_prompt and chat[0]["role"] != "system":
        chat.insert(0, {"role": "system", "content": fields.system_prompt})
    return chat
