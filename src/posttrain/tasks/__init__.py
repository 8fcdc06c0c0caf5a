"""Built-in tasks with verifiable rewards, by name."""

from __future__ import annotations

import difflib

from posttrain.tasks.addition import AdditionTask
from posttrain.tasks.protocol import Problem, Task, is_correct, is_held_out
from posttrain.tasks.reverse import ReverseTask

TASKS: dict[str, Task] = {
    "reverse": ReverseTask(),
    "addition": AdditionTask(),
}


def get_task(name: str) -> Task:
    """The built-in task called `name`; an unknown name suggests the nearest one."""
    try:
        return TASKS[name]
    except KeyError:
        close = difflib.get_close_matches(name, sorted(TASKS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown task {name!r}{hint} (choices: {', '.join(sorted(TASKS))})"
        ) from None


__all__ = [
    "TASKS",
    "AdditionTask",
    "Problem",
    "ReverseTask",
    "Task",
    "get_task",
    "is_correct",
    "is_held_out",
]
