"""The job's task, resolved one way for `posttrain train`, `--resume`, `explain` and `doctor`:
`[run] task` through `posttrain.tasks.resolve_task` (with the `[task]` table as the factory's
arguments), or the dataset task of the `[data]` table; or its environment, `[run] environment`
through `posttrain.environments.resolve_environment` (with the `[environment]` table). Errors
name the key and the config file.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

from posttrain.data.rows import directory_sha256, file_sha256, resolve_spec
from posttrain.environments.protocol import Demonstrating
from posttrain.environments.resolve import (
    EnvironmentSpecError,
    ResolvedEnvironment,
    resolve_environment,
)
from posttrain.jobs.config import DATA_TASK, NO_DATA_TABLE, DataConfig, JobConfig
from posttrain.tasks.dataset import DatasetTask
from posttrain.tasks.judge import Judge
from posttrain.tasks.resolve import ResolvedTask, TaskError, resolve_task
from posttrain.tasks.reward_model import RewardModel, RewardModelConfig
from posttrain.tasks.rewards import JUDGE, MODEL_PREFIX, RewardSource


class JobTaskError(ValueError):
    """The job's task does not resolve: `option` is the config key at fault, `detail` why."""

    def __init__(self, option: str, detail: str, source: Path | None) -> None:
        self.option, self.detail, self.source = option, detail, source
        where = f" in {source}" if source is not None else ""
        super().__init__(f"{option}{where}: {detail}")


def resolve_job_task(config: JobConfig) -> ResolvedTask:
    """The job's task, found as `posttrain train`, `--resume`, `explain` and `doctor` all find
    it; a JobTaskError names `[run] task` (or `[data]`) and the config file."""
    if config.run.task == DATA_TASK:
        if config.data is None:  # parse_config refuses it; a JobConfig built in Python may not
            raise JobTaskError("[run] task", NO_DATA_TABLE, config.source)
        try:
            return _data_task(config.data, config.base_dir, _reward(config))
        except (ValueError, ImportError, FileNotFoundError) as exc:
            raise JobTaskError("[data]", str(exc), config.source) from exc
    try:
        return resolve_task(
            config.run.task, config.task, search=config.base_dir, options_name="[task]"
        )
    except TaskError as exc:
        raise JobTaskError("[run] task", str(exc), config.source) from exc


def resolve_job_environment(config: JobConfig) -> ResolvedEnvironment:
    """The job's environment factory, found as `posttrain train`, `--resume`, `explain` and
    `doctor` all find it; a JobTaskError names `[run] environment` and the config file."""
    spec = config.run.environment
    if spec is None:
        raise JobTaskError("[run] environment", "is not set", config.source)
    try:
        found = resolve_environment(
            spec, config.environment, search=config.base_dir, options_name="[environment]"
        )
    except EnvironmentSpecError as exc:
        raise JobTaskError("[run] environment", str(exc), config.source) from exc
    if config.sft.examples and not found.demonstrates:
        raise JobTaskError(
            "[sft] examples",
            f"environment {spec!r} has no demonstration() to learn from (see "
            f"posttrain.environments.{Demonstrating.__name__}); set [sft] examples = 0, or "
            "warm up on a dataset ([sft] dataset)",
            config.source,
        )
    return found


def _reward(config: JobConfig) -> str | RewardSource:
    """`[data] reward`, or for a model's the object its table builds (nothing loads yet)."""
    assert config.data is not None
    spec = config.data.reward
    if spec == JUDGE:
        if config.judge is None:  # parse_config refuses it; a JobConfig built in Python may not
            raise ValueError('reward = "judge" needs a [judge] table (JobConfig.judge)')
        return Judge(config.judge)
    if spec.startswith(MODEL_PREFIX):
        path = config.base_dir / spec.removeprefix(MODEL_PREFIX)
        return RewardModel(path, config.reward_model or RewardModelConfig())
    return spec


def _data_task(data: DataConfig, base: Path, reward: str | RewardSource) -> ResolvedTask:
    task = DatasetTask.from_file(
        resolve_spec(data.train, base),
        resolve_spec(data.held_out, base) if data.held_out else None,
        held_out_fraction=data.held_out_fraction,
        prompt_field=data.prompt_field,
        messages_field=data.messages_field,
        answer_field=data.answer_field,
        system_prompt=data.system_prompt,
        reward=reward,
        tolerance=data.tolerance,
        pattern=data.pattern,
        search=base,
    )
    details: dict[str, object] = {
        "reward": data.reward,
        "train_problems": len(task.train),
        "held_out_problems": len(task.held_out_problems),
        "dropped_from_train": task.dropped_from_train,
    }
    # A file's or directory's sha256 under "sha256" (as runs have always recorded it), a hub
    # dataset's fingerprint under "fingerprint"; a resume compares both (run_dir.data_changes).
    for key, rows in task.sources.items():
        kind, digest = rows.digest()
        cast(dict[str, str], details.setdefault(kind, {}))[key] = digest
    return ResolvedTask(task, DATA_TASK, "data", "posttrain.tasks.dataset:DatasetTask", details)


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes, or over a directory's files: a resumed run checks its data
    did not change."""
    return directory_sha256(path) if path.is_dir() else file_sha256(path)
