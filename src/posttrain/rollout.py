"""Rollout helpers: chat turns and sampled completions into Trajectories on exact tokens, and
`gather_groups` to run rollout coroutines concurrently.

Sampled assistant tokens are kept exactly as the sampler produced them, with their logprobs;
only the text between turns (user, tool and template tokens) is rendered by the chat template,
and only as the suffix that extends what is already there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable, Mapping, Sequence

from tqdm.auto import tqdm

from posttrain.types import JSONScalar, SampledSequence, TokenSegment, Trajectory, TrajectoryGroup

log = logging.getLogger(__name__)
Message = Mapping[str, str]


class TrajectoryBuilder:
    """Builds one trajectory turn by turn: `prompt(...)`, `completion(...)`, repeat, `build()`."""

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        self.messages: list[dict[str, str]] = []
        self.segments: list[TokenSegment] = []
        self._rendered_upto = 0  # messages whose rendering the tokens already contain

    @property
    def tokens(self) -> list[int]:
        return [t for s in self.segments for t in s.tokens]

    def fork(self) -> TrajectoryBuilder:
        """A copy of the conversation so far (one per completion of a shared prompt)."""
        other = TrajectoryBuilder(self.tokenizer)
        other.messages = [dict(m) for m in self.messages]
        other.segments = list(self.segments)
        return other

    def _render(self, messages: Sequence[Message], generation_prompt: bool) -> list[int]:
        out = self.tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [dict(m) for m in messages],
            add_generation_prompt=generation_prompt,
            tokenize=True,
            return_dict=False,
        )
        return list(out)

    def prompt(self, *messages: Message) -> list[int]:
        """Add user/system/tool messages; returns the tokens to sample the next turn from."""
        if not messages:
            raise ValueError("prompt() needs at least one message")
        before = self._render(self.messages, False) if self.messages else []
        self.messages.extend(dict(m) for m in messages)
        after = self._render(self.messages, True)
        if after[: len(before)] != before:
            raise ValueError(
                "the chat template's rendering of the conversation so far is not a prefix of its "
                "rendering with the new messages; this template cannot be extended turn by turn"
            )
        self.segments.append(TokenSegment(tuple(after[len(before) :]), trainable=False))
        return self.tokens

    def completion(self, sequence: SampledSequence, *, trainable: bool = True) -> str:
        """Add a sampled assistant turn with its exact tokens and logprobs; returns its text."""
        if trainable and sequence.logprobs is None:
            raise ValueError(
                "a trainable completion needs the sampler's logprobs; sample with logprobs or "
                "pass trainable=False"
            )
        self.segments.append(
            TokenSegment(
                tuple(sequence.tokens),
                trainable=trainable,
                logprobs=tuple(sequence.logprobs) if sequence.logprobs is not None else None,
            )
        )
        text = self.tokenizer.decode(sequence.tokens, skip_special_tokens=True)  # type: ignore[attr-defined]
        self.messages.append({"role": "assistant", "content": text})
        return text

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


async def gather_groups(
    groups: Iterable[Awaitable[TrajectoryGroup]],
    *,
    max_exceptions: int = 0,
    desc: str = "rollouts",
    progress: bool = True,
) -> list[TrajectoryGroup]:
    """Await rollout coroutines concurrently, showing progress; tolerate up to `max_exceptions`
    failed groups (dropped and logged), then raise the first failure."""
    if max_exceptions < 0:
        raise ValueError(f"max_exceptions must be >= 0, got {max_exceptions}")
    tasks = [asyncio.ensure_future(g) for g in groups]
    index = {task: i for i, task in enumerate(tasks)}
    results: dict[int, TrajectoryGroup] = {}
    failures = 0
    pending = set(tasks)
    bar = tqdm(total=len(tasks), desc=desc, disable=not progress, leave=False)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                error = task.exception()
                if error is None:
                    results[index[task]] = task.result()
                else:
                    failures += 1
                    log.warning("rollout failed (%d so far): %r", failures, error)
                    if failures > max_exceptions:
                        raise error
                bar.update(1)
            bar.set_postfix(failed=failures)
    finally:
        bar.close()
        for task in pending:
            task.cancel()
    # Groups come back in submission order, whatever order they finished in.
    return [results[i] for i in sorted(results)]
