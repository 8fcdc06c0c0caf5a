"""What an environment is: `reset(seed, split)` starts an episode with its first messages (and
the tools the model may call); `step(message)` answers each assistant message with an
observation (the next messages), a reward and whether the episode is done.

One environment object runs one episode: the runner makes one per episode with the factory
it is given, so an environment keeps its episode's state in itself. Methods may be plain or
`async def` (the runner awaits what they return): an environment that calls a sandbox or a
web service awaits it without blocking the others, a pure-Python one stays plain. The same
seed and split must give the same episode (the job's resume replays steps from their seeds).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from posttrain.tokenizer import ChatMessage

Split = Literal["train", "held_out"]
SPLITS: tuple[Split, ...] = ("train", "held_out")
# What an object needs to be an Environment; `missing_methods` checks them.
ENVIRONMENT_METHODS = ("reset", "step")


def _messages(owner: str, messages: object) -> tuple[ChatMessage, ...]:
    """`messages` as a tuple of chat messages; ValueError naming `owner` otherwise."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ValueError(
            f"{owner} must be a list of chat messages ({{'role': ..., 'content': ...}}), got "
            f"{type(messages).__name__}"
        )
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ValueError(f"{owner}[{i}] must be a chat message with a 'role', got {message!r}")
    return tuple(messages)


@dataclass(frozen=True)
class Reset:
    """How an episode starts: its first messages, and optionally the tools the model may call
    (function schemas, as `tokenizer.apply_chat_template(tools=...)` takes them: the chat
    template shows them to the model, if it renders tools)."""

    messages: Sequence[ChatMessage]
    tools: Sequence[Mapping[str, object]] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "messages", _messages("Reset.messages", self.messages))
        if not self.messages:
            raise ValueError("Reset.messages is empty: an episode starts with a message")
        if self.tools is not None:
            object.__setattr__(self, "tools", tuple(self.tools))


@dataclass(frozen=True)
class Step:
    """What an environment answers to an assistant message.

    `messages` are the observation, the next turn's messages (tool results, a user turn):
    needed unless `done`. `reward` adds to the episode's reward (the trajectory's is the sum),
    `metrics` add up over the episode into the trajectory's metrics. `assistant` is the
    assistant message as the environment read it (say, with the `tool_calls` parsed out of
    its text), recorded in the conversation in place of the raw text; the trajectory keeps
    the sampled tokens either way.
    """

    messages: Sequence[ChatMessage] = ()
    reward: float = 0.0
    done: bool = False
    metrics: Mapping[str, float] = field(default_factory=dict[str, float])
    assistant: ChatMessage | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "messages", _messages("Step.messages", self.messages))
        if not _finite(self.reward):
            raise ValueError(f"Step.reward must be a finite number, got {self.reward!r}")
        if not isinstance(self.done, bool):
            raise ValueError(f"Step.done must be True or False, got {self.done!r}")
        for key, value in self.metrics.items():
            if not isinstance(key, str) or not _finite(value):
                raise ValueError(
                    f"Step.metrics must map names to finite numbers, got {key!r}: {value!r}"
                )
        if self.assistant is not None and self.assistant.get("role") != "assistant":
            raise ValueError(f"Step.assistant must be an assistant message, got {self.assistant!r}")
        if not self.done and not self.messages:
            raise ValueError(
                "Step.messages is empty but the episode is not done: give the next turn's "
                "messages (a tool result, a user turn), or done=True"
            )


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@runtime_checkable
class Environment(Protocol):
    """A multi-turn environment; see the module docstring. Optional methods the runner uses
    when present: `close()` (sync or async) after the episode, and `demonstration()` (see
    `Demonstrating`)."""

    def reset(self, seed: int, split: Split) -> Reset | Awaitable[Reset]:
        """Start the episode of `seed` in `split` ("train", or "held_out" for evaluation:
        keep the two apart, as a task's held-out problems are never trained on)."""
        ...

    def step(self, message: ChatMessage) -> Step | Awaitable[Step]:
        """Answer the assistant's message (`{"role": "assistant", "content": text}`)."""
        ...


@runtime_checkable
class Demonstrating(Protocol):
    """An environment that can show a solved episode: `[sft] examples` trains on these."""

    def demonstration(self) -> Sequence[ChatMessage] | Awaitable[Sequence[ChatMessage]]:
        """After `reset`: the episode's whole conversation, solved (its first messages, then
        each assistant turn as the model should write it, and the observations between)."""
        ...


def missing_methods(obj: object) -> list[str]:
    """What `obj` lacks of the Environment protocol (empty: it is one)."""
    return [name for name in ENVIRONMENT_METHODS if not callable(getattr(obj, name, None))]
