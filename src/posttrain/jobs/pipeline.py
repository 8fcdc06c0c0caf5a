"""Asynchronous RL with bounded staleness: the rollouts of the next steps are sampled while a
step trains.

`rl_steps` runs RL steps `start..steps-1`. With `max_off_policy_steps = N > 0`, the rollouts of
steps k+1..k+N are sampled (asyncio tasks calling `sample(k + j)`) while step k trains, so a
sampling engine in a process of its own (`[inference] devices`, vLLM) samples while the trainer
trains. Step k+j's rollouts then come from the weights of an older model step: before a step
trains, a trajectory sampled by the weights of model step v (its `metadata["policy_version"]`)
is dropped and counted as stale when v < model.step - N, and a group left empty is dropped.
The sampler starts step k+N's rollouts once step k-1 has trained, so with a job's own sampling
none is ever stale; a `sample` function that returns older trajectories gets them dropped.
N = 0 samples each step right before it trains (nothing runs ahead) and trains all of it, as a
plain loop does (a fixed-policy engine's samples, explicitly off-policy, included).

    async with aclosing(rl_steps(backend, model, sample, steps=100, max_off_policy_steps=1)) as run:
        async for trained in run:
            print(trained.step, trained.result.metrics["loss"], trained.max_staleness)
            print(trained.metrics["time/wait_for_rollouts_s"], trained.metrics["staleness/mean"])

Each step's `metrics` say where its time went and how stale its tokens were
(`pipeline_metrics`): the rollouts' sampling seconds, the trainer's wait for them, the
updates, the engine's weight sync after them; the sync's bytes and version; the policy-version
lag of the tokens trained; sampled and trained tokens per second.

Resume: `model.register` restores the weights, the optimizer, the RNG and the step counter,
and a step's rollouts derive from its index alone (the job's `derive_seed(seed, k)`), so the
data cursor, `start`, is exact too. Rollouts in flight when a run is killed are not saved:
the resumed run samples them again from the restored weights, one step newer than the
uninterrupted run used, so with N > 0 the continuation is not bit-identical to a run that
was never interrupted (with N = 0 it is).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from posttrain.backends.model import TrainableModel
from posttrain.backends.options import RLOptions
from posttrain.backends.protocol import TrainableBackend
from posttrain.data.trajectories import Trajectory, TrajectoryGroup
from posttrain.rollouts.task_rollouts import POLICY_VERSION
from posttrain.types import TrainResult

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


@dataclass(frozen=True)
class TrainedStep:
    """RL step `step` (0-based), trained: what it trained and how stale that was."""

    step: int
    groups: tuple[TrajectoryGroup, ...]  # the groups trained, stale trajectories left out
    result: TrainResult
    stale_trajectories: int  # dropped: sampled more than max_off_policy_steps steps before
    max_staleness: int  # the largest model step - policy_version trained on (0: none known)
    # Where the step's time went and how stale its tokens were (`pipeline_metrics`).
    metrics: Mapping[str, float] = field(default_factory=dict[str, float])


@dataclass(frozen=True)
class Rollouts(Generic[T_co]):
    """A step's rollouts, with the seconds they took to sample and the seconds the trainer
    waited for them (0 when they were ready when asked for)."""

    value: T_co
    sample_s: float
    wait_s: float


@dataclass(frozen=True)
class Fresh:
    """A step's groups without their stale trajectories."""

    groups: list[TrajectoryGroup]
    stale_trajectories: int
    max_staleness: int


def drop_stale(
    groups: Sequence[TrajectoryGroup], model_step: int, max_off_policy_steps: int
) -> Fresh:
    """Leave out the trajectories sampled by weights older than model step `model_step -
    max_off_policy_steps`, and the groups left empty. A trajectory whose metadata names no
    policy version is kept (nothing says it is stale). Nothing left is an error."""
    oldest = model_step - max_off_policy_steps
    kept_groups: list[TrajectoryGroup] = []
    stale = staleness = 0
    for group in groups:
        kept: list[Trajectory] = []
        for trajectory in group.trajectories:
            version = trajectory.metadata.get(POLICY_VERSION)
            if not isinstance(version, int) or isinstance(version, bool):
                kept.append(trajectory)
            elif version < oldest:
                stale += 1
            else:
                kept.append(trajectory)
                staleness = max(staleness, model_step - version)
        if len(kept) == len(group):
            kept_groups.append(group)  # untouched: the same object
        elif kept:
            kept_groups.append(
                TrajectoryGroup(
                    kept,
                    exceptions=group.exceptions,
                    metadata=group.metadata,
                    metrics=group.metrics,
                    logs=group.logs,
                )
            )
    if not kept_groups:
        raise ValueError(
            f"every trajectory is stale: sampled before model step {oldest} (model step "
            f"{model_step}, max_off_policy_steps = {max_off_policy_steps}); {stale} dropped"
        )
    return Fresh(kept_groups, stale, staleness)


def token_staleness(groups: Sequence[TrajectoryGroup], model_step: int) -> tuple[int, float]:
    """(max, token-weighted mean) of `model_step - policy_version` over the trainable tokens of
    the trajectories that name their policy version; (0, 0.0) when none does."""
    tokens = lag_tokens = most = 0
    for group in groups:
        for trajectory in group.trajectories:
            version = trajectory.metadata.get(POLICY_VERSION)
            if not isinstance(version, int) or isinstance(version, bool):
                continue
            n = trajectory.num_trainable_tokens
            tokens += n
            lag_tokens += n * (model_step - version)
            most = max(most, model_step - version)
    return most, lag_tokens / tokens if tokens else 0.0


def trainable_tokens(groups: Sequence[TrajectoryGroup]) -> int:
    return sum(t.num_trainable_tokens for g in groups for t in g.trajectories)


def pipeline_metrics(
    sampled: Sequence[TrajectoryGroup],
    trained: Sequence[TrajectoryGroup],
    model_step: int,
    result: TrainResult,
    rollouts: Rollouts[object],
    *,
    train_call_s: float,
    step_s: float,
) -> dict[str, float]:
    """Where an RL step's time went and how stale its tokens were.

    `sampled`: the step's rollouts, sampled in `rollouts.sample_s` seconds, of which the
    trainer waited `rollouts.wait_s` (all of them in a synchronous step); `trained`: those
    handed to the trainer (stale ones left out), at model step `model_step`, in a
    `backend.train` call of `train_call_s` seconds that includes the engine's weight sync
    after the updates (`result.sync`, as `EngineSession.last_sync` holds it): `time/train_s` is that call less the sync. `step_s`
    (`time/step_s`): the trainer's wall time for the step, from asking for its rollouts to the
    end of `backend.train`: the wait, the training, the sync and the little between them.
    A backend whose sampler takes no sync (a fixed-policy engine, Tinker) reports none: 0
    seconds, and no `sync/*`. `tokens/trained` is what the trainer reports it trained
    (`num_trainable_tokens`: it drops groups of equal rewards, and may train none), else the
    tokens of `trained`.
    """
    sync = result.sync
    sync_s = float(sync.get("sync_s", 0.0))
    train_s = max(train_call_s - sync_s, 0.0)
    most, mean = token_staleness(trained, model_step)
    n_sampled = trainable_tokens(sampled)
    n_trained = result.metrics.get("num_trainable_tokens", trainable_tokens(trained))
    metrics = {
        "time/sample_s": rollouts.sample_s,
        "time/wait_for_rollouts_s": rollouts.wait_s,
        "time/train_s": train_s,
        "time/sync_s": sync_s,
        "time/step_s": step_s,
        "staleness/max": float(most),
        "staleness/mean": mean,
        "tokens/sampled": float(n_sampled),
        "tokens/trained": float(n_trained),
        "throughput/sampled_tokens_per_s": _rate(n_sampled, rollouts.sample_s),
        "throughput/trained_tokens_per_s": _rate(n_trained, train_s),
    }
    if sync:
        # The live engine moves no bytes: it samples the trainer's own weights.
        metrics["sync/bytes"] = float(sync.get("sync_bytes", 0.0))
        metrics["sync/version"] = float(sync.get("sync_version", result.step))
    return metrics


# The metrics above whose values depend on the machine's speed, not on the run.
TIMING_METRICS = frozenset(
    {
        "time/sample_s",
        "time/wait_for_rollouts_s",
        "time/train_s",
        "time/sync_s",
        "time/step_s",
        "throughput/sampled_tokens_per_s",
        "throughput/trained_tokens_per_s",
    }
)


def _rate(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


class Prefetch(Generic[T]):
    """`sample(k)` for steps k..k+ahead (below `stop`), started in order as tasks when step k
    is taken; `ahead = 0` awaits `sample(k)` itself when it is taken, with no task. Each is
    timed: `take` says how long it sampled and how long the taker waited."""

    def __init__(self, sample: Callable[[int], Awaitable[T]], *, ahead: int, stop: int) -> None:
        if ahead < 0:
            raise ValueError(f"max_off_policy_steps must be >= 0, got {ahead}")
        self.sample = sample
        self.ahead = ahead
        self.stop = stop
        self._tasks: dict[int, asyncio.Future[tuple[T, float]]] = {}

    async def take(self, k: int) -> Rollouts[T]:
        """Step k's rollouts, once the next `ahead` steps' are under way."""
        asked = time.perf_counter()
        if not self.ahead:
            value, sample_s = await self._timed(k)
        else:
            for j in range(k, min(k + self.ahead + 1, self.stop)):
                if j not in self._tasks:
                    self._tasks[j] = asyncio.ensure_future(self._timed(j))
            value, sample_s = await self._tasks.pop(k)
        return Rollouts(value, sample_s, time.perf_counter() - asked)

    async def _timed(self, k: int) -> tuple[T, float]:
        began = time.perf_counter()
        value = await self.sample(k)
        return value, time.perf_counter() - began

    @property
    def pending(self) -> list[int]:
        """The steps whose rollouts are being sampled, not yet taken."""
        return sorted(self._tasks)

    async def aclose(self) -> None:
        """Cancel the rollouts not taken, and wait until they are done."""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def rl_steps(
    backend: TrainableBackend,
    model: TrainableModel,
    sample: Callable[[int], Awaitable[Sequence[TrajectoryGroup]]],
    *,
    steps: int,
    start: int = 0,
    max_off_policy_steps: int = 0,
    options: Callable[[int], RLOptions] | None = None,
) -> AsyncGenerator[TrainedStep, None]:
    """Train RL steps `start..steps-1` on `sample(k)`'s groups (rewarded, not pending), each
    sampled up to `max_off_policy_steps` model steps before it trains; `options(k)` are step
    k's `backend.train` options, asked for right before it trains (a job saves its data cursor
    there, so that the step's checkpoint holds it).

    Rollouts not yet trained are cancelled when the loop ends or fails; a loop left early
    (`break`) cancels them when the generator is closed: wrap it in `contextlib.aclosing`.
    """
    prefetch = Prefetch(sample, ahead=max_off_policy_steps, stop=steps)
    try:
        for k in range(start, steps):
            asked = time.perf_counter()
            rollouts = await prefetch.take(k)
            model_step = model.step
            if max_off_policy_steps:
                fresh = drop_stale(rollouts.value, model_step, max_off_policy_steps)
            else:  # a plain loop trains what it sampled (a fixed-policy engine's samples too)
                most = token_staleness(rollouts.value, model_step)[0]
                fresh = Fresh(list(rollouts.value), 0, most)
            began = time.perf_counter()
            result = await backend.train(model, fresh.groups, **(options(k) if options else {}))
            trained = time.perf_counter()
            times = {"train_call_s": trained - began, "step_s": trained - asked}
            metrics = pipeline_metrics(
                rollouts.value, fresh.groups, model_step, result, rollouts, **times
            )
            yield TrainedStep(
                k,
                tuple(fresh.groups),
                result,
                fresh.stale_trajectories,
                fresh.max_staleness,
                metrics,
            )
    finally:
        await prefetch.aclose()
