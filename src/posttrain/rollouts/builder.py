"""Chat turns and sampled completions into Trajectories on exact tokens (`gather_groups` in
`posttrain.rollouts.gather` runs rollouts concurrently).

Sampled assistant tokens are kept exactly as the sampler produced them, with their logprobs;
only the text between turns (user, tool and template tokens) is rendered by the chat template,
and only as the suffix that extends what is already there.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from posttrain.data.trajectories import JSONScalar, TokenSegment, Trajectory

# Chat rendering and the turn closing live with the tokenizer (the sampler stops on the end of
# turn too).
from posttrain.tokenizer import (
    ChatMessage,
    Tokenizer,
    TurnClosing,
    assistant_closing,
    render_chat,
)
from posttrain.types import SampledSequence

log = logging.getLogger(__name__)
Message = Mapping[str, str]


class TrajectoryBuilder:
    """Builds one trajectory turn by turn: `prompt(...)`, `completion(...)`, repeat, `build()`.

    The tokens are the conversation's real ones: each sampled turn exactly as sampled, then
    the template's closing tokens of an assistant turn that the sampled tokens lack (the
    end-of-turn token after a completion cut by max_tokens; a newline some templates put after
    it), then the template's rendering of the next messages. `closing` is
    `assistant_closing(tokenizer)`, found on first need unless given (once per tokenizer).
    `tools` (function schemas, as `apply_chat_template(tools=...)` takes them) are given to the
    template with every rendering, so a template that lists them in its system turn does.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        closing: TurnClosing | None = None,
        tools: Sequence[Mapping[str, object]] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = [dict(t) for t in tools] if tools is not None else None
        self.messages: list[dict[str, object]] = []
        self.segments: list[TokenSegment] = []
        self._closing = closing
        self._last: SampledSequence | None = None  # the completion the tokens end with, if any
        self._prompted = False  # the tokens end with a generation prompt: prompt() was last

    @property
    def tokens(self) -> list[int]:
        return [t for s in self.segments for t in s.tokens]

    def fork(self) -> TrajectoryBuilder:
        """A copy of the conversation so far (one per completion of a shared prompt)."""
        other = TrajectoryBuilder(self.tokenizer, closing=self._closing, tools=self.tools)
        other.messages = [dict(m) for m in self.messages]
        other.segments = list(self.segments)
        other._last, other._prompted = self._last, self._prompted
        return other

    def _render(self, messages: Sequence[ChatMessage], generation_prompt: bool) -> list[int]:
        return render_chat(self.tokenizer, messages, generation_prompt, tools=self.tools)

    def closing(self) -> TurnClosing:
        """What the chat template puts after an assistant message's content (cached)."""
        if self._closing is None:
            self._closing = assistant_closing(self.tokenizer)
        return self._closing

    def prompt(self, *messages: ChatMessage) -> list[int]:
        """Add user/system/tool messages; returns the tokens to sample the next turn from.

        A template may render a message differently by what follows it (Qwen's puts
        consecutive tool results in one user turn): give all the messages of one turn at once.
        """
        if not messages:
            raise ValueError("prompt() needs at least one message")
        before = self._render(self.messages, False) if self.messages else []
        extended = [*self.messages, *(dict(m) for m in messages)]
        after = self._render(extended, True)
        if after[: len(before)] != before:
            raise ValueError(
                "the chat template's rendering of the conversation so far is not a prefix of its "
                "rendering with the new messages; this template cannot be extended turn by turn"
            )
        lead: tuple[int, ...] = ()
        if self._last is not None:
            lead = missing_closing(self._last, self.closing())
        elif self._prompted:  # two prompts in a row (rare): one more rendering to find it
            self._drop_generation_prompt(self._render(self.messages, True)[len(before) :])
        self.messages = extended
        self.segments.append(TokenSegment(lead + tuple(after[len(before) :]), trainable=False))
        self._last, self._prompted = None, True
        return self.tokens

    def _drop_generation_prompt(self, generation_prompt: list[int]) -> None:
        """Two prompts in a row: the first one's generation prompt is not part of the text."""
        last = self.segments[-1]
        cut = len(last.tokens) - len(generation_prompt)
        if last.trainable or list(last.tokens[cut:]) != generation_prompt:
            raise ValueError("cannot extend the conversation: its generation prompt is not last")
        self.segments[-1] = TokenSegment(last.tokens[:cut], trainable=False)
        if not self.segments[-1].tokens:
            self.segments.pop()

    def completion(self, sequence: SampledSequence, *, trainable: bool = True) -> str:
        """Add a sampled assistant turn with its exact tokens, logprobs and entropies (if it was
        sampled with them); returns its text."""
        if trainable and sequence.logprobs is None:
            raise ValueError(
                "a trainable completion needs the sampler's logprobs; sample with logprobs or "
                "pass trainable=False"
            )
        if not self.segments:
            raise ValueError("completion() needs a prompt() first")
        self.segments.append(
            TokenSegment(
                tuple(sequence.tokens),
                trainable=trainable,
                logprobs=tuple(sequence.logprobs) if sequence.logprobs is not None else None,
                entropies=tuple(sequence.entropies) if sequence.entropies is not None else None,
            )
        )
        text = str(self.tokenizer.decode(sequence.tokens, skip_special_tokens=True))
        self.messages.append({"role": "assistant", "content": text})
        self._last, self._prompted = sequence, False
        return text

    def set_completion_message(self, message: ChatMessage) -> None:
        """Record the last completion as `message`, e.g. with the `tool_calls` parsed from its
        text: what the chat template renders before the next messages, and what the
        trajectory's messages show. Its tokens stay the sampled ones: the template's rendering
        of the message is never used for them."""
        if self._last is None:
            raise ValueError("set_completion_message() needs a completion() just before it")
        if message.get("role") != "assistant":
            raise ValueError(
                f"set_completion_message() takes an assistant message, got role "
                f"{message.get('role')!r}"
            )
        self.messages[-1] = dict(message)

    def build(
        self,
        reward: float,
        *,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, JSONScalar] | None = None,
    ) -> Trajectory:
        return Trajectory(
            segments=tuple(self.segments),
            reward=reward,
            metrics=dict(metrics or {}),
            metadata=dict(metadata or {}),
            messages=tuple(self.messages),
        )


def missing_closing(sequence: SampledSequence, closing: TurnClosing) -> tuple[int, ...]:
    """The part of `closing` a sampled turn lacks before the next message.

    A completion that stopped on the end-of-turn token lacks only what follows it (nothing for
    posttrain's tiny template, Qwen's newline), whatever it sampled before it (Llama 2's space
    or not); one cut by max_tokens, or stopped by a stop sequence, lacks all of it.
    """
    end_of_turn = closing.through_end[-1:]
    if (
        sequence.stop_reason == "stop"
        and end_of_turn
        and tuple(sequence.tokens[-1:]) == end_of_turn
    ):
        return closing.after_end
    return closing.tokens
