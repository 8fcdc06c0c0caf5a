"""What a registered model logs: history.jsonl, its trajectory files and the metric sinks."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar, Literal

from posttrain.data.trajectories import TrajectoryGroup
from posttrain.logging_sinks import Sink
from posttrain.run_records import trajectory_record

Split = Literal["train", "val", "test"]


class ModelLog:
    """history.jsonl, the trajectory files and the metric sinks of a registered model: what
    `log` writes and `history` reads, for TrainableModel and Model alike."""

    # Trajectory files record each trajectory's token segments (a trained model's are exact;
    # an inference-only model's server need not return token ids).
    logs_tokens: ClassVar[bool] = True
    _sinks: list[Sink]

    @property
    def directory(self) -> Path:
        raise NotImplementedError

    @property
    def step(self) -> int:
        raise NotImplementedError

    async def log(
        self,
        groups: Sequence[TrajectoryGroup] | None = None,
        *,
        split: Split = "train",
        metrics: Mapping[str, float] | None = None,
        step: int | None = None,
    ) -> dict[str, float]:
        """Append reward statistics and `metrics` to history.jsonl and save the trajectories."""
        step = self.step if step is None else step
        row: dict[str, float] = {}
        if groups:
            rewards = [t.reward for g in groups for t in g.trajectories]
            row["reward"] = statistics.fmean(rewards)
            failed = sum(len(g.exceptions) for g in groups)
            if failed:  # rollouts dropped by gather_trajectory_groups within max_exceptions
                row["exceptions"] = float(failed)
            row["reward_std"] = statistics.pstdev(rewards) if len(rewards) > 1 else 0.0
            row["num_trajectories"] = float(len(rewards))
            for key in sorted({k for g in groups for t in g.trajectories for k in t.metrics}):
                values = [
                    t.metrics[key] for g in groups for t in g.trajectories if key in t.metrics
                ]
                row[key] = statistics.fmean(values)
            self._write_trajectories(groups, split, step)
        row.update({k: float(v) for k, v in (metrics or {}).items()})
        record = {"step": step, "split": split, **{k: _json_float(v) for k, v in row.items()}}
        with open(self.directory / "history.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        for sink in self._sinks:
            sink.write(split, step, row)
        return row

    def _write_trajectories(self, groups: Sequence[TrajectoryGroup], split: str, step: int) -> None:
        folder = self.directory / "trajectories" / split
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"{step:05d}.jsonl", "w") as f:
            for gi, group in enumerate(groups):
                for trajectory in group.trajectories:
                    f.write(json.dumps(trajectory_record(trajectory, gi, self.logs_tokens)) + "\n")

    def history(self) -> list[dict[str, object]]:
        path = self.directory / "history.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _json_float(value: float) -> float | None:
    return value if math.isfinite(value) else None
