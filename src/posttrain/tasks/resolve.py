"""Finding a task by name: a built-in, a dotted path, or an installed entry point.

- A built-in name ("reverse", "addition", "word-problems") is its class, called with the options.
- A dotted path "mypkg.tasks:make_task" names a factory (a class or function), called with the
  options as keyword arguments, or an object that already is a Task (then without options).
- Any other name is looked up in the `posttrain.tasks` entry-point group, whose entries are
  dotted paths as above: `[project.entry-points."posttrain.tasks"] mytask = "mypkg.tasks:make"`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from posttrain.finder import Kind, NotFound, did_you_mean, find, target_of
from posttrain.finder import entry_points as installed
from posttrain.tasks.addition import AdditionTask
from posttrain.tasks.protocol import TASK_METHODS, Task, is_task, missing_methods
from posttrain.tasks.reverse import ReverseTask
from posttrain.tasks.word_problems import WordProblemsTask

ENTRY_POINT_GROUP = "posttrain.tasks"
TaskKind = Literal["builtin", "path", "entry_point", "data"]
BUILTIN_TASKS: dict[str, type] = {
    "reverse": ReverseTask,
    "addition": AdditionTask,
    "word-problems": WordProblemsTask,
}
TASKS = Kind("task", BUILTIN_TASKS, ENTRY_POINT_GROUP, example="mypkg.tasks:make_task")


class TaskError(ValueError):
    """A task spec that does not resolve to a Task; the message says what to fix."""


@dataclass(frozen=True)
class ResolvedTask:
    """A task and how it was found: what job.json records and `posttrain explain` shows."""

    task: Task
    spec: str  # as given: "reverse", "mypkg.tasks:make_task", an entry-point name, "data"
    kind: TaskKind
    target: str  # module:qualname of the factory or object the spec names
    details: Mapping[str, object] = field(default_factory=dict[str, object])  # e.g. data files

    def record(self) -> dict[str, object]:
        return {"spec": self.spec, "kind": self.kind, "target": self.target, **self.details}


def entry_points() -> dict[str, str]:
    """Installed tasks: name -> dotted path, from the `posttrain.tasks` entry-point group."""
    return installed(ENTRY_POINT_GROUP)


def task_kind(spec: str) -> TaskKind:
    """Which kind of spec this is, without importing anything; an unknown name lists the
    known ones."""
    try:
        return find(spec, TASKS).source
    except NotFound as exc:
        raise TaskError(str(exc)) from None


def resolve_task(
    spec: str,
    options: Mapping[str, object] | None = None,
    *,
    search: Path | None = None,
    options_name: str = "options",
) -> ResolvedTask:
    """The task `spec` names, built with `options` (a factory's keyword arguments).

    `search` is a directory to import dotted paths from after `sys.path` (the job passes its
    config file's); `options_name` is how errors name the options (the job's `[task]` table).
    Every failure is a TaskError saying which module, attribute, option or method is at fault.
    """
    options = dict(options or {})
    try:
        found = find(spec, TASKS)
        factory = found.load(search=search)
    except NotFound as exc:
        raise TaskError(str(exc)) from exc
    task = _build(factory, spec, options, options_name)
    return ResolvedTask(task=task, spec=spec, kind=found.source, target=target_of(factory))


def _build(obj: object, spec: str, options: dict[str, object], options_name: str) -> Task:
    """`obj` itself when it is a Task, else what calling it with `options` returns."""
    if not isinstance(obj, type) and is_task(obj):
        if options:
            raise TaskError(
                f"task {spec!r} is a Task object, not a factory: it takes no {options_name} "
                f"(got {', '.join(options)}); name a factory to pass them to"
            )
        return obj
    if not callable(obj):
        raise TaskError(
            f"task {spec!r} is a {type(obj).__name__}, neither a factory nor a Task (it lacks "
            f"{', '.join(missing_methods(obj))})"
        )
    label = getattr(obj, "__qualname__", repr(obj))
    check_options(obj, spec, label, options, options_name)
    try:
        task = obj(**options)
    except Exception as exc:  # user code may fail in any way: say whose and how
        raise TaskError(
            f"task {spec!r}: {label}({_call_args(options)}) raised {type(exc).__name__}: {exc}"
        ) from exc
    if not is_task(task):
        missing = missing_methods(task)
        raise TaskError(
            f"task {spec!r}: {label}() returned a {type(task).__name__}, which is not a Task: it "
            f"lacks {', '.join(missing)} (a Task has {', '.join(TASK_METHODS)}; see "
            "posttrain.tasks.Task)"
        )
    return task


def check_options(
    factory: Callable[..., object],
    spec: str,
    label: str,
    options: Mapping[str, object],
    options_name: str,
    *,
    what: str = "task",
) -> None:
    """A TaskError unless `options` are keyword arguments `factory` takes, all it needs;
    `what` is how errors name the spec ("task", "environment")."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # not introspectable (a builtin): the call will tell
        return
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in options:
        if key not in named:
            takes = ", ".join(named) or "nothing"
            raise TaskError(
                f"{what} {spec!r}: unknown {options_name} key {key!r}{did_you_mean(key, named)} "
                f"({label} takes: {takes})"
            )
    required = [
        n
        for n, p in params.items()
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    missing = [n for n in required if n not in options]
    if missing:
        raise TaskError(
            f"{what} {spec!r}: {label} needs {', '.join(map(repr, missing))}; give "
            f"{' and '.join(f'{m} = ...' for m in missing)} in {options_name}"
        )


def _call_args(options: Mapping[str, object]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in options.items())
