"""The rollout runner: episodes of an environment as trajectories with several trainable turns.

`run_episodes` plays `group_size` episodes of each seed, each with its own environment, in
lockstep: every turn, all episodes still going are sampled in one `sample_many` call (the
sampler batches them), then the environments answer concurrently. Each trajectory holds the
exact sampled tokens of every assistant turn (trainable, with their logprobs) and the chat
template's rendering of the messages in between (`TrajectoryBuilder`); its reward is the sum
of the step rewards. The episodes of one seed form one `TrajectoryGroup`.

Limits and stop reasons (each trajectory's `stop_reason` metadata, and `stop_<reason>`
metrics whose means are the share of episodes that stopped so):
- "done": the environment said so;
- "max_turns": `limits.max_turns` assistant turns were sampled;
- "context": the next turn might not fit `limits.max_context` tokens (its prompt plus the
  per-turn `max_tokens`), so it is not sampled.
An episode cut by a limit is kept and trained as far as it went, with the rewards it earned:
dropping it would hide from the policy what running out of turns costs. A turn cut by
`max_tokens` goes to the environment like any other (a tool call left open is its to judge).

An episode whose environment raises (in the factory, `reset` or `step`), returns something
else than a `Reset`/`Step`, or sends messages the chat template cannot add, is an
`EpisodeError`: dropped whole (never a half-built trajectory) and returned in
`Episodes.errors`; more than `max_exceptions` of them raise the first.

Determinism: with a seeded `SamplingParams`, the same seeds give the same trajectories (each
turn's sampling seed derives from the params' seed and the turn), as long as the environment
gives the same episode for the same seed.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from posttrain.data.trajectories import Trajectory, TrajectoryGroup
from posttrain.environments.protocol import SPLITS, Environment, Reset, Split, Step
from posttrain.environments.protocol import missing_methods as missing_env_methods
from posttrain.inference.protocol import Sampler
from posttrain.rollouts.builder import TrajectoryBuilder
from posttrain.rollouts.gather import EpisodeError
from posttrain.tokenizer import ChatMessage, Tokenizer, TurnClosing, as_tokenizer, assistant_closing
from posttrain.types import SampledSequence, SamplingParams

log = logging.getLogger(__name__)
EpisodeStop = Literal["done", "max_turns", "context"]
STOPS: tuple[EpisodeStop, ...] = ("done", "max_turns", "context")


@dataclass(frozen=True)
class EpisodeLimits:
    """How long an episode may run: assistant turns, and tokens in its whole context."""

    max_turns: int = 8
    max_context: int | None = None  # None: no limit beyond the model's own

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.max_context is not None and self.max_context < 1:
            raise ValueError(f"max_context must be >= 1 or None, got {self.max_context}")


@dataclass(frozen=True)
class Episodes:
    """What `run_episodes` played: a group per seed (seeds whose episodes all failed have
    none), the failures, and how many episodes were started."""

    groups: list[TrajectoryGroup]
    errors: list[EpisodeError]
    episodes: int


@dataclass
class _Episode:
    seed: int
    group: int  # the seed's position: which group the trajectory joins
    env: Environment | None = None
    builder: TrajectoryBuilder | None = None
    pending: tuple[ChatMessage, ...] = ()  # messages to add before the next turn
    reward: float = 0.0
    turns: int = 0
    sampled: int = 0
    metrics: dict[str, float] = field(default_factory=dict[str, float])
    stop: EpisodeStop | None = None
    error: EpisodeError | None = None

    @property
    def running(self) -> bool:
        return self.stop is None and self.error is None


async def run_episodes(
    sampler: Sampler,
    make_env: Callable[[], Environment],
    seeds: Sequence[int],
    params: SamplingParams,
    *,
    group_size: int = 1,
    split: Split = "train",
    limits: EpisodeLimits | None = None,
    max_exceptions: int | None = 0,
    name: str | None = None,
) -> Episodes:
    """`group_size` episodes of each seed; see the module docstring.

    `params.max_tokens` bounds each turn. `max_exceptions=None` returns every failure without
    raising (the caller decides); `name` is how errors name the environment.
    """
    limits = limits or EpisodeLimits()
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if limits.max_context is not None and params.max_tokens is None:
        raise ValueError("a max_context limit needs SamplingParams.max_tokens (per turn)")
    label: str = name or getattr(make_env, "__qualname__", None) or repr(make_env)
    tokenizer = as_tokenizer(sampler.tokenizer)
    closing = assistant_closing(tokenizer)
    episodes = [_Episode(seed, i) for i, seed in enumerate(seeds) for _ in range(group_size)]
    try:
        await asyncio.gather(
            *(_start(e, make_env, split, tokenizer, closing, label) for e in episodes)
        )
        for turn in itertools.count():
            live = [e for e in episodes if e.running and _ready(e, limits, params, label)]
            if not live:
                break
            turn_params = replace(params, seed=_turn_seed(params.seed, turn))
            responses = await sampler.sample_many([_tokens(e) for e in live], 1, turn_params)
            await asyncio.gather(
                *(
                    _take_turn(e, r.sequences[0], label)
                    for e, r in zip(live, responses, strict=True)
                )
            )
    finally:
        await asyncio.gather(*(_close(e, label) for e in episodes))
    errors = [e.error for e in episodes if e.error is not None]
    if max_exceptions is not None and len(errors) > max_exceptions:
        raise errors[0]
    return Episodes(_groups(episodes, len(seeds)), errors, len(episodes))


async def _maybe_await(value: object) -> object:
    """What a plain or `async def` method returned."""
    if inspect.isawaitable(value):
        return await value
    return value


def _tokens(e: _Episode) -> list[int]:
    assert e.builder is not None  # a running episode was reset
    return e.builder.tokens


def _where(name: str, e: _Episode) -> str:
    return f"environment {name!r}, seed {e.seed}, turn {e.turns}"


async def _start(
    e: _Episode,
    make_env: Callable[[], Environment],
    split: Split,
    tokenizer: Tokenizer,
    closing: TurnClosing,
    name: str,
) -> None:
    """Make the episode's environment and reset it."""
    try:
        env = make_env()
    except Exception as exc:  # the environment's code may fail in any way: say whose and how
        e.error = EpisodeError(f"{_where(name, e)}: the factory raised {type(exc).__name__}: {exc}")
        return
    missing = missing_env_methods(env)
    if missing:
        e.error = EpisodeError(
            f"{_where(name, e)}: the factory made a {type(env).__name__}, which lacks "
            f"{', '.join(missing)}"
        )
        return
    e.env = env
    try:
        reset = await _maybe_await(env.reset(e.seed, split))
    except Exception as exc:
        e.error = EpisodeError(f"{_where(name, e)}: reset raised {type(exc).__name__}: {exc}")
        return
    if not isinstance(reset, Reset):
        e.error = EpisodeError(
            f"{_where(name, e)}: reset() returned a {type(reset).__name__}; return "
            "posttrain.environments.Reset(messages=[...])"
        )
        return
    e.builder = TrajectoryBuilder(tokenizer, closing=closing, tools=reset.tools)
    e.pending = tuple(reset.messages)


def _ready(e: _Episode, limits: EpisodeLimits, params: SamplingParams, name: str) -> bool:
    """Add the pending messages and say whether the episode samples another turn; sets its
    stop reason (or error) when not."""
    assert e.builder is not None
    if e.turns >= limits.max_turns:
        e.stop = "max_turns"
        return False
    # On a copy: a turn that does not fit leaves the trajectory ending with the last one.
    builder = e.builder.fork()
    try:
        builder.prompt(*e.pending)
    except Exception as exc:  # the template rejects the environment's messages
        e.error = EpisodeError(
            f"{_where(name, e)}: the chat template cannot add the environment's messages "
            f"{list(e.pending)!r}: {type(exc).__name__}: {exc}"
        )
        return False
    if limits.max_context is not None:
        needed = len(builder.tokens) + (params.max_tokens or 0)
        if needed > limits.max_context:
            if e.turns == 0:
                e.error = EpisodeError(
                    f"{_where(name, e)}: the first prompt ({len(builder.tokens)} tokens) and a "
                    f"turn of max_tokens {params.max_tokens} do not fit max_context "
                    f"{limits.max_context}"
                )
            else:
                e.stop = "context"
            return False
    e.builder, e.pending = builder, ()
    return True


async def _take_turn(e: _Episode, sequence: SampledSequence, name: str) -> None:
    """Add the sampled turn and let the environment answer it."""
    assert e.builder is not None and e.env is not None
    text = e.builder.completion(sequence)
    e.turns += 1
    e.sampled += len(sequence.tokens)
    try:
        step = await _maybe_await(e.env.step({"role": "assistant", "content": text}))
    except Exception as exc:  # the environment's code may fail in any way: say whose and how
        e.error = EpisodeError(f"{_where(name, e)}: step raised {type(exc).__name__}: {exc}")
        return
    if not isinstance(step, Step):
        e.error = EpisodeError(
            f"{_where(name, e)}: step() returned a {type(step).__name__}; return "
            "posttrain.environments.Step(messages=..., reward=..., done=...)"
        )
        return
    if step.assistant is not None:
        e.builder.set_completion_message(step.assistant)
    e.reward += step.reward
    for key, value in step.metrics.items():
        e.metrics[key] = e.metrics.get(key, 0.0) + value
    if step.done:
        e.stop = "done"
    else:
        e.pending = tuple(step.messages)


async def _close(e: _Episode, name: str) -> None:
    close = getattr(e.env, "close", None)
    if not callable(close):
        return
    try:
        await _maybe_await(close())
    except Exception as exc:  # the episode is over: a failed close is reported, not fatal
        log.warning("%s: close raised %s: %s", _where(name, e), type(exc).__name__, exc)


def _groups(episodes: Sequence[_Episode], seeds: int) -> list[TrajectoryGroup]:
    trajectories: list[list[Trajectory]] = [[] for _ in range(seeds)]
    for e in episodes:
        if e.error is None and e.builder is not None:
            trajectories[e.group].append(_trajectory(e))
    return [TrajectoryGroup(tuple(group)) for group in trajectories if group]


def _trajectory(e: _Episode) -> Trajectory:
    assert e.builder is not None
    metrics = {
        **e.metrics,
        "accuracy": float(e.reward >= 1.0),
        "turns": float(e.turns),
        "sampled_tokens": float(e.sampled),
        **{f"stop_{stop}": float(e.stop == stop) for stop in STOPS},
    }
    return e.builder.build(
        e.reward, metrics=metrics, metadata={"seed": e.seed, "stop_reason": e.stop}
    )


def _turn_seed(seed: int | None, turn: int) -> int | None:
    """Turn `turn`'s sampling seed: its own stream, so turns do not repeat each other's draws."""
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}:turn:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


@dataclass(frozen=True)
class EnvironmentEvaluation:
    """Greedy episodes on held-out seeds: accuracy (share with reward >= 1), mean reward."""

    accuracy: float
    mean_reward: float
    trajectories: list[Trajectory]

    @classmethod
    def of(cls, groups: Sequence[TrajectoryGroup]) -> EnvironmentEvaluation:
        """The evaluation of played episodes (at least one)."""
        trajectories = [t for g in groups for t in g.trajectories]
        rewards = [t.reward for t in trajectories]
        return cls(
            accuracy=sum(r >= 1.0 for r in rewards) / len(rewards),
            mean_reward=sum(rewards) / len(rewards),
            trajectories=trajectories,
        )


async def evaluate_environment(
    sampler: Sampler,
    make_env: Callable[[], Environment],
    seeds: Sequence[int],
    *,
    max_tokens: int = 64,
    limits: EpisodeLimits | None = None,
    name: str | None = None,
) -> EnvironmentEvaluation:
    """One greedy episode per held-out seed; an episode that fails is an error."""
    if not seeds:
        raise ValueError("evaluate_environment() got no seeds")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=0)
    played = await run_episodes(
        sampler, make_env, seeds, params, split="held_out", limits=limits, name=name
    )
    return EnvironmentEvaluation.of(played.groups)
