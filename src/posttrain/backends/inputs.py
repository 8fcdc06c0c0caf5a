"""What `train`, `train_sft` and `train_dpo` accept: any iterable (a list, a tuple, a generator), read once.

The trainer reads its input more than once (advantages, then datums; batches, then counts), so
every backend turns what it was given into a list here, at the API boundary, before anything
reads it. A generator read twice would give nothing the second time: a step that trains nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from posttrain.data.preferences import PreferencePair
from posttrain.data.trajectories import Trajectory, TrajectoryGroup

T = TypeVar("T")


def group_list(groups: Iterable[TrajectoryGroup], call: str) -> list[TrajectoryGroup]:
    """`groups` as a list, each item checked to be a TrajectoryGroup."""
    return _checked_list(groups, TrajectoryGroup, call, "trajectory groups")


def trajectory_list(trajectories: Iterable[Trajectory], call: str) -> list[Trajectory]:
    """`trajectories` as a list, each item checked to be a Trajectory."""
    return _checked_list(trajectories, Trajectory, call, "trajectories")


def pair_list(pairs: Iterable[PreferencePair], call: str) -> list[PreferencePair]:
    """`pairs` as a list, each item checked to be a PreferencePair."""
    return _checked_list(pairs, PreferencePair, call, "preference pairs")


def _checked_list(items: Iterable[T], kind: type[T], call: str, what: str) -> list[T]:
    if isinstance(items, (kind, str, bytes)) or not isinstance(items, Iterable):
        raise TypeError(
            f"{call} takes an iterable of {what} (a list or a generator), got a "
            f"{type(items).__name__}; wrap it in a list"
        )
    listed = list(items)
    for index, item in enumerate(listed):
        if not isinstance(item, kind):
            hint = (
                "; wrap each prompt's trajectories in TrajectoryGroup(...)"
                if kind is TrajectoryGroup and isinstance(item, Trajectory)
                else ""
            )
            raise TypeError(
                f"{call}: item {index} is a {type(item).__name__}, not a {kind.__name__}{hint}"
            )
    return listed
