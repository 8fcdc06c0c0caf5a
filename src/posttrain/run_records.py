"""What a model's run directory records, read and written as plain data: a trajectory as a line
of a trajectory file, and the best checkpointed step by a logged metric."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from posttrain.data.trajectories import Trajectory


def best_step(history: Sequence[Mapping[str, object]], metric: str, steps: Sequence[int]) -> int:
    """Of `steps`, the one with the highest mean of `metric` ("<split>/<key>") over its
    history rows; the later on a tie. ValueError if no row of those steps has it."""
    split, _, key = metric.partition("/")
    values: dict[int, list[float]] = {}
    for row in history:
        value, step = row.get(key), row.get("step")
        if row.get("split") == split and isinstance(value, int | float) and step in steps:
            values.setdefault(int(step), []).append(float(value))  # pyright: ignore[reportArgumentType]
    if not values:
        logged = sorted(
            {f"{r.get('split')}/{k}" for r in history for k in r if k not in ("step", "split")}
        )
        raise ValueError(
            f"best_checkpoint_metric={metric!r}: no history row of a step with a checkpoint "
            f"({list(steps)}) has it, so nothing was deleted; metrics logged: "
            f"{logged or 'none'} (model.log(groups, split=...) writes '<split>/reward')"
        )
    return max(values, key=lambda step: (statistics.fmean(values[step]), step))


def trajectory_record(trajectory: Trajectory, group: int, tokens: bool = True) -> dict[str, object]:
    """A trajectory as a line of a trajectory file; `tokens=False` leaves out its segments
    (an inference-only model's choices need not carry token ids)."""
    record: dict[str, object] = {
        "group": group,
        "reward": trajectory.reward,
        "metrics": dict(trajectory.metrics),
        "metadata": dict(trajectory.metadata),
        "messages": [dict(m) for m in trajectory.messages],
        **({"tools": [dict(t) for t in trajectory.tools]} if trajectory.tools else {}),
    }
    if tokens:
        record["segments"] = [
            {
                "tokens": list(s.tokens),
                "trainable": s.trainable,
                "logprobs": list(s.logprobs) if s.logprobs else None,
            }
            for s in trajectory.segments
        ]
    return record
