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
N = 0 samples each step right before it trains (nothing runs ahead), as a plain loop does.

    async with aclosing(rl_steps(backend, model, sample, steps=100, max_off_policy_steps=1)) as run:
        async for trained in run:
            print(trained.step, trained.result.metrics["loss"], trained.max_staleness)

Resume: `model.register` restores the weights, the optimizer, the RNG and the step counter,
and a step's rollouts derive from its index alone (the job's `derive_seed(seed, k)`), so the
data cursor, `start`, is exact too. Rollouts in flight when a run is killed are not saved:
the resumed run samples them again from the restored weights, one step newer than the
uninterrupted run used, so with N > 0 the continuation is not bit-identical to a run that
was never interrupted (with N = 0 it is).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from posttrain.backends.model import TrainableModel
from posttrain.backends.options import RLOptions
from posttrain.backends.protocol import TrainableBackend
from posttrain.data.trajectories import Trajectory, TrajectoryGroup
from posttrain.rollouts.task_rollouts import POLICY_VERSION
from posttrain.types import TrainResult

T = TypeVar("T")


@dataclass(frozen=True)
class TrainedStep:
    """RL step `step` (0-based), trained: what it trained and how stale that was."""

    step: int
    groups: tuple[TrajectoryGroup, ...]  # the groups trained, stale trajectories left out
    result: TrainResult
    stale_trajectories: int  # dropped: sampled more than max_off_policy_steps steps before
    max_staleness: int  # the largest model step - policy_version trained on (0: none known)


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


class Prefetch(Generic[T]):
    """`sample(k)` for steps k..k+ahead (below `stop`), started in order as tasks when step k
    is taken; `ahead = 0` awaits `sample(k)` itself when it is taken, with no task."""

    def __init__(self, sample: Callable[[int], Awaitable[T]], *, ahead: int, stop: int) -> None:
        if ahead < 0:
            raise ValueError(f"max_off_policy_steps must be >= 0, got {ahead}")
        self.sample = sample
        self.ahead = ahead
        self.stop = stop
        self._tasks: dict[int, asyncio.Future[T]] = {}

    async def take(self, k: int) -> T:
        """Step k's rollouts, once the next `ahead` steps' are under way."""
        if not self.ahead:
            return await self.sample(k)
        for j in range(k, min(k + self.ahead + 1, self.stop)):
            if j not in self._tasks:
                self._tasks[j] = asyncio.ensure_future(self.sample(j))
        return await self._tasks.pop(k)

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
    k's `backend.train` options, asked for right before it trains.

    Rollouts not yet trained are cancelled when the loop ends or fails; a loop left early
    (`break`) cancels them when the generator is closed: wrap it in `contextlib.aclosing`.
    """
    prefetch = Prefetch(sample, ahead=max_off_policy_steps, stop=steps)
    try:
        for k in range(start, steps):
            fresh = drop_stale(await prefetch.take(k), model.step, max_off_policy_steps)
            result = await backend.train(model, fresh.groups, **(options(k) if options else {}))
            yield TrainedStep(
                k, tuple(fresh.groups), result, fresh.stale_trajectories, fresh.max_staleness
            )
    finally:
        await prefetch.aclose()
