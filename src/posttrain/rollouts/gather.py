"""Run rollouts concurrently: posttrain's `gather_groups` and ART's `gather_trajectory_groups`,
one implementation under two names.

Each item is an awaitable of a TrajectoryGroup (a coroutine that rolls out a whole group), or a
TrajectoryGroup, which may be pending: made of rollout awaitables, as ART's
`TrajectoryGroup(rollout(model, scenario) for _ in range(8))`. Everything runs at once.

A failed rollout is counted. In a pending group, each rollout counts one; the group keeps the
others and the error in its `exceptions`. An awaitable that raises counts one and its group is
dropped. A rollout whose trajectory cannot give exact tokens (a choice without token ids, a
prompt that does not extend the turn before it) fails like one that raised: no trajectory is
trained half-built. Up to `max_exceptions` failures are tolerated, as ART counts them: an int
is a number of rollouts, a float below 1 a fraction of all of them. The first failure past the
bound is raised and the rollouts still running are cancelled; so is the first failure when no
rollout succeeds. Tolerated failures are logged with their error, shown in the progress bar
and summed up in a warning at the end: a step never loses rollouts silently.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Sequence

from tqdm.auto import tqdm

from posttrain.data.trajectories import Trajectory, TrajectoryGroup

log = logging.getLogger(__name__)


class EpisodeError(ValueError):
    """An episode that failed in its environment or on its messages; dropped whole, and
    counted as a tolerated failure like a reward's (`task_rollouts.check_bad_rollouts`)."""


GroupItem = Awaitable[TrajectoryGroup] | TrajectoryGroup
AfterEach = Callable[
    [TrajectoryGroup], Awaitable[TrajectoryGroup | Sequence[TrajectoryGroup] | None]
]


class _Tally:
    """Rollouts done and failed across one gather; raises the failure that passes the bound."""

    def __init__(self, total: int, max_exceptions: int | float, bar: tqdm) -> None:
        self.total, self.max_exceptions, self.bar = total, max_exceptions, bar
        self.failed: list[BaseException] = []

    def tolerates(self, failures: int) -> bool:
        bound = self.max_exceptions
        if isinstance(bound, float) and bound < 1:
            return failures <= bound * self.total
        return failures <= bound

    def done(self, _trajectory: Trajectory | None = None) -> None:
        self.bar.update(1)
        if self.failed:
            self.bar.set_postfix(failed=len(self.failed))

    def fail(self, error: BaseException) -> None:
        self.failed.append(error)
        self.bar.update(1)
        self.bar.set_postfix(failed=len(self.failed))
        if not self.tolerates(len(self.failed)):
            raise error
        log.warning(
            "rollout failed (%d of %d so far, max_exceptions=%s): %r",
            len(self.failed),
            self.total,
            self.max_exceptions,
            error,
        )


def check_max_exceptions(value: object) -> int | float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"max_exceptions must be an int or a float, got {value!r}")
    if not (0 <= value < math.inf):
        raise ValueError(
            f"max_exceptions must be >= 0 (a count, or a fraction below 1), got {value!r}"
        )
    return value


async def gather_groups(
    groups: Iterable[GroupItem],
    *,
    max_exceptions: int | float = 0,
    desc: str = "rollouts",
    progress: bool = True,
    after_each: AfterEach | None = None,
) -> list[TrajectoryGroup]:
    """Run every group's rollouts concurrently, showing progress; the groups in the order
    given, failed rollouts dropped within `max_exceptions` (see the module docstring).
    `after_each(group)`, awaited as each group completes, may return it changed, None to drop
    it, or several groups in its place."""
    bound = check_max_exceptions(max_exceptions)
    items = list(groups)
    total = sum(max(len(g), 1) if isinstance(g, TrajectoryGroup) else 1 for g in items)
    bar = tqdm(total=total, desc=desc, disable=not progress, leave=False)
    tally = _Tally(total, bound, bar)
    tasks = [asyncio.ensure_future(_one(item, tally, after_each)) for item in items]
    try:
        results = await asyncio.gather(*tasks)
    finally:
        bar.close()
        for task in tasks:
            task.cancel()
    out = [g for result in results for g in result]
    if tally.failed and not out:
        raise tally.failed[0]
    if tally.failed:
        log.warning(
            "%d of %d rollouts failed and were dropped (max_exceptions=%s); the first: %r",
            len(tally.failed),
            total,
            bound,
            tally.failed[0],
        )
    return out


async def gather_trajectory_groups(
    groups: Iterable[GroupItem],
    *,
    pbar_desc: str | None = "gather",
    max_exceptions: int | float = 0,
    after_each: AfterEach | None = None,
) -> list[TrajectoryGroup]:
    """ART's name and keywords for `gather_groups` (`pbar_desc=None` shows no progress bar)."""
    return await gather_groups(
        groups,
        max_exceptions=max_exceptions,
        desc=pbar_desc or "",
        progress=pbar_desc is not None,
        after_each=after_each,
    )


async def _one(
    item: GroupItem, tally: _Tally, after_each: AfterEach | None
) -> list[TrajectoryGroup]:
    """One item's groups: none if it failed (counted), else its group (or after_each's)."""
    if isinstance(item, TrajectoryGroup):
        group = await item.run(on_error=tally.fail, on_done=tally.done)
    else:
        try:
            group = await item
            if not isinstance(group, TrajectoryGroup):
                raise TypeError(
                    f"a rollout returned a {type(group).__name__}; gather_groups takes "
                    "awaitables of TrajectoryGroups, or TrajectoryGroups"
                )
            # A pending group returned runs here; any of its rollouts failing fails it whole.
            group = await group.run()
        except Exception as exc:
            tally.fail(exc)
            return []
        tally.done()
    if group is None:
        return []
    if after_each is None:
        return [group]
    try:
        changed = await after_each(group)
    except Exception as exc:
        tally.fail(exc)
        return []
    if changed is None:
        return []
    return [changed] if isinstance(changed, TrajectoryGroup) else list(changed)
