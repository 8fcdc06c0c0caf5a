"""`resolve_task`: built-in names with options, dotted paths (factories and Task objects), the
`posttrain.tasks` entry-point group, and errors that name the module, attribute, option or
missing methods; through the job they also name `[run] task` and the config file, and
`posttrain explain` and `posttrain doctor` resolve the task the same way."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from posttrain.cli.main import main
from posttrain.jobs.config import load_config
from posttrain.jobs.job_task import JobTaskError, resolve_job_task
from posttrain.tasks import ReverseTask, TaskError, resolve_task

TASKS_MODULE = '''
from dataclasses import dataclass
import random

from posttrain.tasks import Problem, ReverseTask


def make_task(max_length: int = 6, *, name: str = "short"):
    return ReverseTask(name=name, max_length=max_length)


@dataclass(frozen=True)
class Copy:
    """A task written from scratch: copy a word."""

    name: str = "copy"

    def make_prompts(self, rng, n):
        return [self._problem(rng) for _ in range(n)]

    def held_out(self, seed, n):
        return [self._problem(random.Random(seed * 1000 + i)) for i in range(n)]

    def reward(self, problem, completion, stop_reason):
        return float(completion == problem.answer)

    def solution(self, problem):
        return problem.answer

    def _problem(self, rng):
        word = "".join(rng.choice("abc") for _ in range(3))
        return Problem(f"copy {word}", word)


COPY = Copy()
VERSION = "1"


class Partial:
    name = "partial"

    def make_prompts(self, rng, n):
        return []


def partial():
    return Partial()


def broken(size: int = 1):
    raise RuntimeError(f"no data for size {size}")
'''


@pytest.fixture
def packages(tmp_path, monkeypatch):
    """`mytasks` and a module that fails to import, on sys.path; an installed distribution
    declaring two tasks in the `posttrain.tasks` entry-point group."""
    root = tmp_path / "site"
    (root / "mytasks").mkdir(parents=True)
    (root / "mytasks" / "__init__.py").write_text(TASKS_MODULE)
    (root / "broken_import.py").write_text("import no_such_dependency_xyz\n")
    info = root / "mytasks-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mytasks\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[posttrain.tasks]\ncopy = mytasks:COPY\nshort = mytasks:make_task\n"
        "gone = mytasks:nothing_here\n"
    )
    monkeypatch.syspath_prepend(str(root))
    for name in ("mytasks", "broken_import"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return root


def test_builtin_with_options():
    resolved = resolve_task("reverse", {"max_length": 4})
    assert resolved.task == ReverseTask(max_length=4)
    assert (resolved.kind, resolved.target) == ("builtin", "posttrain.tasks.reverse:ReverseTask")
    assert resolved.record() == {
        "spec": "reverse",
        "kind": "builtin",
        "target": "posttrain.tasks.reverse:ReverseTask",
    }


def test_dotted_path_factory_and_task_object(packages):
    made = resolve_task("mytasks:make_task", {"max_length": 3})
    assert made.task == ReverseTask(name="short", max_length=3)
    assert (made.kind, made.target) == ("path", "mytasks:make_task")
    plain = resolve_task("mytasks:make_task")  # a factory called with no arguments
    assert plain.task == ReverseTask(name="short")
    copy = resolve_task("mytasks:COPY")  # already a Task: used as it is
    assert copy.task.name == "copy" and copy.target == "mytasks:Copy"
    assert resolve_task("mytasks:Copy").task == copy.task  # a class is a factory


def test_entry_points(packages):
    copy = resolve_task("copy")
    assert (copy.kind, copy.task.name, copy.target) == ("entry_point", "copy", "mytasks:Copy")
    short = resolve_task("short", {"max_length": 5})
    assert short.task == ReverseTask(name="short", max_length=5)
    with pytest.raises(TaskError, match=r"unknown task 'shrt'; did you mean 'short'\?"):
        resolve_task("shrt")
    with pytest.raises(
        TaskError,
        match=r"task 'gone' \(entry point in posttrain.tasks\) 'mytasks:nothing_here': 'mytasks' "
        "has no attribute 'nothing_here'",
    ):
        resolve_task("gone")


@pytest.mark.parametrize(
    ("spec", "options", "message"),
    [
        (
            "broken_import:make",
            {},
            r"module 'broken_import' does not import: ModuleNotFoundError: No module named "
            r"'no_such_dependency_xyz'",
        ),
        ("no_such_pkg.tasks:make", {}, r"module 'no_such_pkg.tasks' does not import"),
        (
            "mytasks:make_tsk",
            {},
            r"'mytasks' has no attribute 'make_tsk'; did you mean 'make_task'\?",
        ),
        (
            "mytasks:broken",
            {"size": 3},
            r"task 'mytasks:broken': broken\(size=3\) raised RuntimeError: no data for size 3",
        ),
        (
            "mytasks:partial",
            {},
            r"partial\(\) returned a Partial, which is not a Task: it lacks held_out, reward, "
            r"solution \(a Task has name, make_prompts, held_out, reward, solution",
        ),
        (
            "mytasks:make_task",
            {"max_lenght": 3},
            r"unknown options key 'max_lenght'; did you mean 'max_length'\?",
        ),
        (
            "mytasks:COPY",
            {"x": 1},
            r"is a Task object, not a factory: it takes no options \(got x\)",
        ),
        ("mytasks:VERSION", {}, r"is a str, neither a factory nor a Task"),
        ("mytasks.make_task", {}, r"unknown task 'mytasks.make_task'"),
        ("my tasks:x", {}, r"is not a dotted path; write it as 'package.module:name'"),
    ],
)
def test_errors_name_what_is_wrong(packages, spec, options, message):
    with pytest.raises(TaskError, match=message):
        resolve_task(spec, options)


def _config(path: Path, body: str) -> Path:
    path.write_text(body)
    return path


def test_the_job_resolves_with_the_table_and_names_the_config(packages, tmp_path):
    config = _config(
        tmp_path / "job.toml",
        '[run]\ntask = "mytasks:make_task"\n[task]\nmax_length = 3\nname = "mine"\n',
    )
    resolved = resolve_job_task(load_config(config))
    assert resolved.task == ReverseTask(name="mine", max_length=3)
    _config(config, '[run]\ntask = "mytasks:broken"\n')
    with pytest.raises(JobTaskError) as caught:
        resolve_job_task(load_config(config))
    assert str(caught.value) == (
        f"[run] task in {config}: task 'mytasks:broken': broken() raised RuntimeError: no data "
        "for size 1"
    )
    for spec, why in [
        ("broken_import:make", "module 'broken_import' does not import: ModuleNotFoundError"),
        ("mytasks:nothing", "'mytasks' has no attribute 'nothing'"),
        ("mytasks:partial", "partial() returned a Partial, which is not a Task: it lacks held_out"),
    ]:
        _config(config, f'[run]\ntask = "{spec}"\n')
        with pytest.raises(JobTaskError) as caught:
            resolve_job_task(load_config(config))
        assert str(caught.value).startswith(f"[run] task in {config}: task '{spec}': {why}")
    _config(config, '[run]\ntask = "mytasks:make_task"\n[task]\nlength = 3\n')
    with pytest.raises(JobTaskError, match=r"unknown \[task\] key 'length'"):
        resolve_job_task(load_config(config))


def test_a_module_beside_the_config_imports_without_pythonpath(tmp_path, monkeypatch):
    (tmp_path / "beside_config_tasks.py").write_text(TASKS_MODULE)
    monkeypatch.delitem(sys.modules, "beside_config_tasks", raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))  # restored after the test
    monkeypatch.chdir("/")  # not the working directory: the config's
    config = _config(tmp_path / "job.toml", '[run]\ntask = "beside_config_tasks:COPY"\n')
    assert resolve_job_task(load_config(config)).task.name == "copy"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            '[run]\ntask = "reverse"\n[data]\ntrain = "t.jsonl"\n',
            r"\[data\] describes a dataset task, but \[run\] task = 'reverse'",
        ),
        ('[run]\ntask = "data"\n', r"\[run\] task = \"data\" needs a \[data\] table"),
        (
            '[data]\ntrain = "t.jsonl"\n[task]\nx = 1\n',
            r"\[task\] holds a task factory's arguments",
        ),
        ("[data]\nreward = 'exact'\n", r"\[data\] train is required"),
        (
            "[data]\ntrain = 't.jsonl'\nreward = 'exakt'\n",
            r"\[data\] reward 'exakt' is unknown; did you mean 'exact'",
        ),
        ("[run]\ntask = 'revers'\n", r"\[run\] unknown task 'revers'; did you mean 'reverse'"),
    ],
)
def test_config_errors(tmp_path, body, message):
    with pytest.raises(ValueError, match=message):
        load_config(_config(tmp_path / "job.toml", body))


def test_explain_and_doctor_resolve_the_task_as_the_job_does(
    packages, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # where a job would write its run (it must not)
    config = _config(
        tmp_path / "job.toml",
        '[run]\ntask = "mytasks:make_task"\n[task]\nmax_length = 3\n'
        "[rl]\nprompts_per_step = 2\n[eval]\nheld_out = 5\n",
    )
    assert main(["explain", str(config), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["task"] == {
        "spec": "mytasks:make_task",
        "kind": "path",
        "target": "mytasks:make_task",
    }
    assert report["config"]["task"] == {"max_length": 3}
    assert report["plan"]["held_out_problems"] == 5
    assert main(["doctor", "--config", str(config), "--storage", str(tmp_path)]) in (0, 1)
    out = capsys.readouterr().out
    assert "PASS  task" in out and "mytasks:make_task (path: mytasks:make_task)" in out

    _config(config, '[run]\ntask = "mytasks:partial"\n')
    assert main(["explain", str(config)]) == 1
    out = capsys.readouterr().out
    assert "  - [run] task: task 'mytasks:partial': partial() returned a Partial" in out
    assert f"(config {config})" in out
    main(["doctor", "--config", str(config), "--storage", str(tmp_path)])
    assert "FAIL  task" in capsys.readouterr().out
    assert main(["train", str(config)]) == 2  # refused before anything is written
    err = capsys.readouterr().err
    assert "posttrain train: preflight: [run] task: task 'mytasks:partial'" in err
    assert not (tmp_path / "runs").exists()
