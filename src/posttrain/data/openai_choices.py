"""OpenAI-client rollouts: completions and chat completions as trajectories on exact tokens.

A choice from posttrain's OpenAI-compatible endpoints (or from vLLM's, asked with
`return_token_ids`) carries the tokens the model read (`prompt_token_ids`), the tokens it
sampled (`token_ids`) and the logprob of each sampled token. A trajectory is built from its
choices alone, never by rendering a chat template:

    turn 1's prompt (context) | turn 1's sampled tokens (trainable, with their logprobs)
    | the part of turn 2's prompt after turn 1's prompt + sampled tokens (context: tool
    results, user turns, template tokens) | turn 2's sampled tokens (trainable) | ...

The messages between choices are not tokenized here: each choice's prompt already holds them.

When a later prompt does not start with the earlier prompt and sampled tokens (a chat template
that rewrites history, a reply cut at a stop string, an edited assistant message), the
trajectory is refused with an error naming the turn and the fix. posttrain trains a trajectory
as one token sequence, under one advantage and one loss reduction; a second sequence under the
same reward would need the trainer to treat several sequences as one trajectory, and making
each turn a trajectory of its own would count the reward once per turn in its group's
baseline. Either way the result would differ from what was sampled and rewarded, so the
mismatch is an error rather than an approximation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from posttrain.data.checks import is_mapping, is_sequence
from posttrain.data.segments import MessageOrChoice, TokenSegment

TOKEN_IDS_HINT = (
    "sample through posttrain's endpoint (model.openai_client(), or `posttrain serve`), or a "
    "vLLM server (0.10.2 or later) asked with extra_body={'return_token_ids': True}"
)


@dataclass(frozen=True)
class SampledTurn:
    """One sampled turn on exact tokens: what the model read, what it sampled, the logprobs."""

    prompt_tokens: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.tokens):
            raise ValueError(
                f"{len(self.logprobs)} logprobs for {len(self.tokens)} sampled tokens; "
                "give one logprob per sampled token"
            )


def is_message(item: object) -> bool:
    """A chat message (a mapping with a "role"), as opposed to a choice."""
    return isinstance(item, Mapping) and "role" in item


def field_of(item: object, name: str) -> object:
    """`item[name]` of a mapping, else `item.name` (an `openai` object keeps the fields it does
    not know, such as `token_ids`, as attributes); None where absent."""
    if is_mapping(item):
        return item.get(name)
    return getattr(item, name, None)


def sampled_turn(
    choice: object, *, prompt_token_ids: Sequence[int] | None = None, where: str = "choice"
) -> SampledTurn:
    """The exact tokens of one OpenAI choice (chat or text completion, object or dict).

    `prompt_token_ids` is for a choice that lacks its own (vLLM puts a chat response's on the
    response). `where` names the choice in errors.
    """
    tokens = _ids(field_of(choice, "token_ids"), f"{where}.token_ids", "the sampled token ids")
    prompt = field_of(choice, "prompt_token_ids")
    if prompt is None:
        prompt = prompt_token_ids
    prompt_ids = _ids(prompt, f"{where}.prompt_token_ids", "the prompt's token ids")
    if not prompt_ids:
        raise ValueError(f"{where}.prompt_token_ids is empty: a sampled turn has a prompt")
    return SampledTurn(prompt_ids, tokens, _logprobs(choice, len(tokens), where))


def _ids(value: object, name: str, what: str) -> tuple[int, ...]:
    if value is None:
        raise ValueError(
            f"{name} is missing: the server that answered did not return {what}, so the "
            f"trajectory cannot be built on exact tokens; {TOKEN_IDS_HINT}"
        )
    if not is_sequence(value):
        raise ValueError(f"{name} must be a list of token ids, got {type(value).__name__}")
    ids: list[int] = []
    for i, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"{name}[{i}] is {token!r}; token ids are integers >= 0")
        ids.append(token)
    return tuple(ids)


def _logprobs(choice: object, count: int, where: str) -> tuple[float, ...]:
    """The sampled tokens' logprobs: a chat choice's `logprobs.content[i].logprob`, or a text
    completion choice's `logprobs.token_logprobs`."""
    logprobs = field_of(choice, "logprobs")
    if logprobs is None:
        raise ValueError(
            f"{where}.logprobs is missing: training needs the sampler's logprob of each sampled "
            "token; ask with logprobs=True (chat) or logprobs=0 (completions), or sample with "
            "model.openai_client(), which asks for them"
        )
    content = field_of(logprobs, "content")
    if content is not None:
        values = [field_of(entry, "logprob") for entry in _list(content, f"{where}.logprobs")]
        name = f"{where}.logprobs.content"
    else:
        values = _list(field_of(logprobs, "token_logprobs"), f"{where}.logprobs.token_logprobs")
        name = f"{where}.logprobs.token_logprobs"
    if len(values) != count:
        raise ValueError(
            f"{name} has {len(values)} entries for {count} sampled tokens (token_ids); a "
            "trainable turn needs one logprob per sampled token"
        )
    out: list[float] = []
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name}[{i}] is {value!r}, not a logprob")
        out.append(float(value))
    return tuple(out)


def _list(value: object, name: str) -> list[object]:
    if not is_sequence(value):
        raise ValueError(f"{name} must be a list, got {type(value).__name__}")
    return list(value)


def segments_from_turns(
    turns: Sequence[SampledTurn], names: Sequence[str] | None = None
) -> tuple[TokenSegment, ...]:
    """One token sequence from sampled turns: each turn's new prompt tokens as context, its
    sampled tokens trainable. ValueError naming the turn (by `names`, else its number) whose
    prompt does not extend the tokens before it (see the module docstring)."""
    if not turns:
        raise ValueError("no sampled turn: a trajectory needs at least one choice")
    segments: list[TokenSegment] = []
    done: tuple[int, ...] = ()
    for number, turn in enumerate(turns, start=1):
        prompt = turn.prompt_tokens
        if prompt[: len(done)] != done:
            name = names[number - 1] if names else f"turn {number}"
            raise ValueError(_not_extending(name, number, done, prompt))
        if len(prompt) > len(done):
            segments.append(TokenSegment(prompt[len(done) :], trainable=False))
        if turn.tokens:
            segments.append(TokenSegment(turn.tokens, trainable=True, logprobs=turn.logprobs))
        done = prompt + turn.tokens
    return tuple(segments)


def _not_extending(name: str, number: int, done: tuple[int, ...], prompt: tuple[int, ...]) -> str:
    at = next(
        (i for i, (a, b) in enumerate(zip(done, prompt, strict=False)) if a != b),
        min(len(done), len(prompt)),
    )
    found = f"token {prompt[at]}" if at < len(prompt) else "the prompt's end"
    return (
        f"{name}: its prompt_token_ids do not start with the tokens of turns 1-{number - 1} "
        f"(their prompt and sampled tokens, {len(done)} tokens): at position {at} the prompt "
        f"has {found} where turn {number - 1} has token {done[at]}. The chat template rendered "
        "an earlier turn differently from how it was sampled (an assistant message edited or "
        "re-formatted, a reply cut at a stop string, a template that drops earlier reasoning "
        "or re-writes tool calls), and posttrain trains a trajectory as one exact token "
        "sequence, so it does not guess. Fix: send each assistant message back as the server "
        "returned it (trajectory.messages() does); with stop strings, ask with "
        "extra_body={'include_stop_str_in_output': True}; use a chat template that keeps "
        "earlier turns as sampled; or make each turn a Trajectory of its own"
    )


def segments_from_messages_and_choices(
    items: Sequence[MessageOrChoice],
) -> tuple[TokenSegment, ...]:
    """The token segments of ART's `messages_and_choices`: messages are skipped (each choice's
    prompt holds them), choices give the tokens (`segments_from_turns`)."""
    turns: list[SampledTurn] = []
    names: list[str] = []
    for index, item in enumerate(items):
        if is_message(item):
            continue
        name = f"messages_and_choices[{index}]"
        turns.append(sampled_turn(item, where=name))
        names.append(f"{name} (turn {len(turns)})")
    if not turns:
        raise ValueError(
            f"messages_and_choices holds {len(items)} messages and no choice: nothing was "
            "sampled to train on; append the choice each completion returned "
            "(completion.choices[0]) to messages_and_choices"
        )
    return segments_from_turns(turns, names)


def message_of(item: MessageOrChoice) -> dict[str, object]:
    """A message as a dict; a choice as the assistant message it carries (a text completion's
    `text` as its content), with its tool calls."""
    if isinstance(item, Mapping) and "role" in item:
        return {str(key): value for key, value in item.items()}
    message = field_of(item, "message")
    if message is None:
        return {"role": "assistant", "content": field_of(item, "text")}
    out: dict[str, object] = {"role": "assistant", "content": field_of(message, "content")}
    tool_calls = field_of(message, "tool_calls")
    if tool_calls:
        out["tool_calls"] = [_plain(call) for call in _list(tool_calls, "message.tool_calls")]
    return out


def _plain(value: object) -> object:
    """An `openai` object as plain JSON data (what a request sends back)."""
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return dump(exclude_none=True)
    return value


def attach_prompt_token_ids(response: object) -> None:
    """Copy a chat response's `prompt_token_ids` onto each of its choices that lacks them.

    vLLM puts a chat completion's prompt ids on the response only; posttrain's server puts
    them on each choice too, so a choice alone builds a trajectory. Call this on a vLLM
    response before putting its choices in `messages_and_choices`.
    """
    prompt = field_of(response, "prompt_token_ids")
    choices = field_of(response, "choices")
    if prompt is None or choices is None:
        return
    for choice in _list(choices, "response.choices"):
        if field_of(choice, "prompt_token_ids") is None:
            if isinstance(choice, dict):
                choice["prompt_token_ids"] = prompt
            else:
                setattr(choice, "prompt_token_ids", prompt)  # noqa: B010 - an extra field
