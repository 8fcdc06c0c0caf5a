"""Tasks: built-in ones by name, your own by dotted path or entry point, and dataset tasks
(JSONL files and a reward) that need no code. `resolve_task` finds any of them. Rewards from
models: `Judge` (an LLM judge behind an OpenAI-compatible endpoint) and `RewardModel` (a local
sequence-classification model)."""

from __future__ import annotations

from posttrain.finder import did_you_mean
from posttrain.tasks.addition import AdditionTask
from posttrain.tasks.dataset import DatasetTask
from posttrain.tasks.judge import Judge, JudgeConfig, JudgeError
from posttrain.tasks.protocol import Problem, Task, is_correct, is_held_out, missing_methods
from posttrain.tasks.resolve import BUILTIN_TASKS, ResolvedTask, TaskError, resolve_task
from posttrain.tasks.reverse import ReverseTask
from posttrain.tasks.reward_meter import RewardMeter, reward_step
from posttrain.tasks.reward_model import RewardModel, RewardModelConfig
from posttrain.tasks.word_problems import WordProblemsTask

# The built-in tasks with their default settings.
TASKS: dict[str, Task] = {
    "reverse": ReverseTask(),
    "addition": AdditionTask(),
    "word-problems": WordProblemsTask(),
}


def get_task(name: str) -> Task:
    """The built-in task called `name`; an unknown name suggests the nearest one."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(
            f"unknown task {name!r}{did_you_mean(name, TASKS)} (choices: {', '.join(sorted(TASKS))})"
        ) from None


__all__ = [
    "BUILTIN_TASKS",
    "TASKS",
    "AdditionTask",
    "DatasetTask",
    "Judge",
    "JudgeConfig",
    "JudgeError",
    "Problem",
    "ResolvedTask",
    "ReverseTask",
    "RewardMeter",
    "RewardModel",
    "RewardModelConfig",
    "Task",
    "TaskError",
    "WordProblemsTask",
    "get_task",
    "is_correct",
    "is_held_out",
    "missing_methods",
    "resolve_task",
    "reward_step",
]
