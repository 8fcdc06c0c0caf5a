"""Trajectories and groups: what rollouts produced, in posttrain's form or in ART's.

A `Trajectory` is one episode: its tokens in segments (sampled runs trainable, with the
sampler's logprobs; everything else context), a reward, metrics, metadata and the chat
messages. It is built in one of two forms:

- posttrain's: `Trajectory(segments, reward)`, from a sampler or a `TrajectoryBuilder`;
- ART's: `Trajectory(messages_and_choices=[...], reward=...)`, chat messages (dicts) and the
  OpenAI choices sampled between them. Its tokens come from the choices' token ids
  (`posttrain.data.openai_choices`), never from a chat template. A rollout may append to
  `messages_and_choices` after construction, as ART's rollouts do, so until the rollout is
  checked (`check_trajectory`, when its group runs) each read derives them afresh; the check
  stores them, and from then on the trajectory holds one form, its segments.

A trajectory's reward may be assigned later (`trajectory.reward = 1.0`); every assignment is
checked to be a finite number. A `TrajectoryGroup` holds trajectories, or awaitables of them
(rollouts still to run): awaiting the group, or gathering it with
`posttrain.rollouts.builder.gather_trajectory_groups`, runs them.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from posttrain.data.checks import is_instance
from posttrain.data.openai_choices import message_of, segments_from_messages_and_choices
from posttrain.data.segments import (
    JSONScalar,
    MessageOrChoice,
    Messages,
    TokenSegment,
)

if TYPE_CHECKING:  # the openai SDK is optional: its types name what the tools are
    from openai.types.chat import ChatCompletionToolParam


# Trajectory metadata keys the trainer reads: the model step whose weights sampled it, and the
# sampling temperature (the parity check, `trainer.parity`, compares only on-policy tokens).
POLICY_VERSION = "policy_version"
SAMPLING_TEMPERATURE = "sampling_temperature"

GetT = TypeVar("GetT")
SetT = TypeVar("SetT")


class _Checked(Generic[GetT, SetT]):
    """A dataclass field whose value passes its owner's `_put_<name>` on every assignment and
    is read by its `_read_<name>`; `dataclasses.replace`, `==` and `repr` see it as a field."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._read, self._put = f"_read_{name}", f"_put_{name}"

    @overload
    def __get__(self, obj: None, owner: type) -> _Checked[GetT, SetT]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> GetT: ...
    def __get__(self, obj: object | None, owner: type) -> Any:
        return self if obj is None else getattr(obj, self._read)()

    def __set__(self, obj: object, value: SetT) -> None:
        getattr(obj, self._put)(value)


def finite_reward(value: object) -> float:
    """`value` as a float; ValueError unless it is a finite real number."""
    number: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
    elif not isinstance(value, bool | str | bytes) and hasattr(value, "__float__"):
        number = float(value)  # pyright: ignore[reportArgumentType]  # numpy and torch scalars
    if number is None:
        raise ValueError(
            f"Trajectory.reward must be a finite number, got {type(value).__name__} {value!r}"
        )
    if not math.isfinite(number):
        raise ValueError(f"Trajectory.reward must be a finite number, got {value!r}")
    return number


@dataclass(init=False, eq=True)
class Trajectory:
    """One episode: token segments in order, a scalar reward, metrics, metadata and the chat
    messages (for display and the next request; never used to rebuild tokens).

    `segments` and `messages` are given (posttrain's form), or derived from
    `messages_and_choices` (ART's form; see the module docstring). Given ones win, so
    `dataclasses.replace(trajectory, segments=...)` keeps working on either form.
    """

    segments: _Checked[tuple[TokenSegment, ...], Sequence[TokenSegment] | None] = _Checked()
    reward: _Checked[float, float] = _Checked()
    metrics: dict[str, float]
    metadata: dict[str, JSONScalar]
    messages: _Checked[Messages, Sequence[Mapping[str, object]]] = _Checked()
    messages_and_choices: list[MessageOrChoice] | None
    tools: list[ChatCompletionToolParam] | None
    logs: list[str]

    def __init__(
        self,
        segments: Sequence[TokenSegment] | None = None,
        reward: float = 0.0,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, JSONScalar] | None = None,
        messages: Sequence[Mapping[str, object]] = (),
        *,
        messages_and_choices: Iterable[MessageOrChoice] | None = None,
        tools: Iterable[ChatCompletionToolParam] | None = None,
        logs: Iterable[str] = (),
    ) -> None:
        if segments is None and messages_and_choices is None:
            raise ValueError(
                "Trajectory needs its tokens: give segments (TokenSegments), or "
                "messages_and_choices (chat messages and the OpenAI choices sampled between them)"
            )
        if isinstance(messages_and_choices, str | Mapping):
            kind = type(messages_and_choices).__name__  # pyright: ignore[reportUnknownArgumentType]
            raise ValueError(
                f"Trajectory.messages_and_choices is a list of messages and choices, got a {kind}; "
                "wrap it in a list"
            )
        self.messages_and_choices = (
            None if messages_and_choices is None else list(messages_and_choices)
        )
        self.segments = segments
        self.reward = reward
        self.metrics = dict(metrics or {})
        self.metadata = dict(metadata or {})
        self._messages: Messages | None = None
        if messages or messages_and_choices is None:
            self.messages = messages
        self.tools = None if tools is None else list(tools)
        self.logs = list(logs)

    def _put_segments(self, segments: Sequence[TokenSegment] | None) -> None:
        if segments is None:
            self._segments: tuple[TokenSegment, ...] | None = None
            return
        if isinstance(segments, TokenSegment):
            raise ValueError("Trajectory.segments is a sequence of TokenSegments; wrap it in (...)")
        segments = tuple(segments)
        if not segments:
            raise ValueError("Trajectory.segments is empty: a trajectory needs tokens")
        for index, segment in enumerate(segments):
            if not is_instance(segment, TokenSegment):
                raise ValueError(
                    f"Trajectory.segments[{index}] is a {type(segment).__name__}, not a "
                    "TokenSegment"
                )
        self._segments = segments

    def _read_segments(self) -> tuple[TokenSegment, ...]:
        """The given (or checked) segments, else those of the choices in
        `messages_and_choices` as they are now; ValueError naming the choice if they cannot
        give exact tokens."""
        if self._segments is not None:
            return self._segments
        return segments_from_messages_and_choices(tuple(self.messages_and_choices or ()))

    def _put_reward(self, value: object) -> None:
        # The reward may be assigned after the rollout; a NaN must never reach the advantages.
        self._reward = finite_reward(value)

    def _read_reward(self) -> float:
        return self._reward

    def _put_messages(self, messages: Sequence[Mapping[str, object]]) -> None:
        if isinstance(messages, str | Mapping):
            raise ValueError("Trajectory.messages is a sequence of message dicts; wrap it in (...)")
        self._messages = Messages(messages)

    def _read_messages(self) -> Messages:
        """The given messages, or those of `messages_and_choices`, each choice as the assistant
        message it carries."""
        if self._messages is not None or self.messages_and_choices is None:
            return self._messages or Messages()
        return Messages(message_of(item) for item in self.messages_and_choices)

    def check(self) -> None:
        """Derive an ART-form trajectory's segments once and keep them: its one form from now
        on (a rollout's end; `check_trajectory`). ValueError naming a choice that cannot give
        exact tokens."""
        if self._segments is None:
            self.segments = self._read_segments()

    @property
    def tokens(self) -> list[int]:
        return [t for seg in self.segments for t in seg.tokens]

    @property
    def num_trainable_tokens(self) -> int:
        return sum(len(seg.tokens) for seg in self.segments if seg.trainable)

    def log(self, message: str) -> None:
        """Append a line to `logs` (ART's `trajectory.log`)."""
        self.logs.append(message)


@dataclass(init=False, eq=True)
class TrajectoryGroup:
    """Trajectories sampled for the same prompt; advantages are computed within a group.

    Given awaitables (rollouts still to run, e.g. a generator of coroutines), the group is
    pending: `await group` runs them and gives the group of their trajectories, where a rollout
    that raises fails the await. `gather_trajectory_groups` runs many groups at once and
    tolerates a bounded number of failures, recorded in the result's `exceptions`.
    """

    trajectories: _Checked[tuple[Trajectory, ...], Iterable[object]] = _Checked()
    exceptions: tuple[BaseException, ...]
    metadata: dict[str, JSONScalar]
    metrics: dict[str, float]
    logs: list[str]

    def __init__(
        self,
        trajectories: Iterable[Trajectory | Awaitable[Trajectory]] = (),
        *,
        exceptions: Iterable[BaseException] = (),
        metadata: Mapping[str, JSONScalar] | None = None,
        metrics: Mapping[str, float] | None = None,
        logs: Iterable[str] = (),
    ) -> None:
        self._trajectories: tuple[Trajectory, ...] = ()
        self._pending: tuple[Awaitable[Trajectory], ...] = ()
        self.trajectories = trajectories
        self.exceptions = tuple(exceptions)
        self.metadata = dict(metadata or {})
        self.metrics = dict(metrics or {})
        self.logs = list(logs)

    def _put_trajectories(self, trajectories: Iterable[object]) -> None:
        if isinstance(trajectories, Trajectory):
            raise ValueError("TrajectoryGroup.trajectories is a list of trajectories; wrap it")
        done: list[Trajectory] = []
        pending: list[Awaitable[Trajectory]] = []
        for index, item in enumerate(trajectories):
            if isinstance(item, Trajectory):
                done.append(item)
            elif inspect.isawaitable(item):
                pending.append(item)
            else:
                raise ValueError(
                    f"TrajectoryGroup.trajectories[{index}] is a {type(item).__name__}, not a "
                    "Trajectory or an awaitable of one (a rollout coroutine)"
                )
        if not done and not pending:
            raise ValueError("TrajectoryGroup.trajectories is empty: a group needs trajectories")
        self._trajectories, self._pending = tuple(done), tuple(pending)

    def _read_trajectories(self) -> tuple[Trajectory, ...]:
        if self._pending:
            raise ValueError(
                f"this TrajectoryGroup has {len(self._pending)} rollouts not yet run: await it, "
                "or gather it with `await gather_trajectory_groups([...])`, before training"
            )
        return self._trajectories

    @property
    def num_pending(self) -> int:
        """Rollouts given as awaitables and not yet run."""
        return len(self._pending)

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    def __len__(self) -> int:
        return len(self._trajectories) + len(self._pending)

    def __iter__(self) -> Iterator[Trajectory]:
        return iter(self.trajectories)

    def __await__(self) -> Generator[object, None, TrajectoryGroup]:
        return self._run_all().__await__()

    async def _run_all(self) -> TrajectoryGroup:
        group = await self.run()
        assert group is not None  # without on_error, the first failure raises
        return group

    async def run(
        self,
        on_error: Callable[[BaseException], None] | None = None,
        on_done: Callable[[Trajectory], None] | None = None,
    ) -> TrajectoryGroup | None:
        """Run the pending rollouts concurrently; the group of every trajectory (None if none
        is left). A rollout that raises, or gives a trajectory whose tokens cannot be built
        (never trained half-built), goes to `on_error`, which raises to stop (the default:
        the error itself) or returns to drop it; dropped errors are kept in `exceptions`.
        `on_done` sees each trajectory kept."""
        kept: list[Trajectory] = []
        failed = list(self.exceptions)

        def settle(result: object) -> None:
            try:
                if isinstance(result, BaseException):
                    raise result
                trajectory = check_trajectory(result)
            except Exception as exc:
                failed.append(exc)
                if on_error is None:
                    raise
                on_error(exc)
                return
            kept.append(trajectory)
            if on_done is not None:
                on_done(trajectory)

        for trajectory in self._trajectories:
            settle(trajectory)
        tasks = [asyncio.ensure_future(p) for p in self._pending]
        try:
            for next_done in asyncio.as_completed(tasks):
                try:
                    result: object = await next_done
                except Exception as exc:
                    result = exc
                settle(result)
        finally:
            for task in tasks:
                task.cancel()
        if not kept:
            return None
        return TrajectoryGroup(
            kept, exceptions=failed, metadata=self.metadata, metrics=self.metrics, logs=self.logs
        )


def check_trajectory(trajectory: object) -> Trajectory:
    """A rollout's result, once its tokens are known to build (they are derived here, so a
    trajectory that cannot give exact tokens fails its rollout, never the training step)."""
    if not isinstance(trajectory, Trajectory):
        raise TypeError(
            f"a rollout returned a {type(trajectory).__name__}; rollouts in a TrajectoryGroup "
            "return a Trajectory"
        )
    trajectory.check()
    return trajectory
