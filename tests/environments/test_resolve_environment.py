"""`resolve_environment`: the built-in calculator with options, a dotted path (class or
function) from a package of the test's own, the `posttrain.environments` entry-point group,
and bad input: errors name the factory and what it lacks, and through the job `[run]
environment` and the config file; `posttrain explain` and `doctor` resolve it the same way."""

from __future__ import annotations

import json
import sys

import pytest

from posttrain.cli.main import main
from posttrain.environments import CalculatorEnv, EnvironmentSpecError, resolve_environment
from posttrain.jobs.config import load_config
from posttrain.jobs.job_task import JobTaskError, resolve_job_environment

ENVS_MODULE = '''
from posttrain.environments import Reset, Step


class Echo:
    """Says its word back; done after one turn."""

    def __init__(self, word: str = "hi"):
        self.word = word

    def reset(self, seed, split):
        return Reset([{"role": "user", "content": self.word}])

    def step(self, message):
        return Step(reward=float(message["content"] == self.word), done=True)


def make_echo(word="yo"):
    return Echo(word)


def make_nothing():
    return {"reset": "not a method"}


class NoStep:
    def reset(self, seed, split):
        return Reset([{"role": "user", "content": "x"}])


ECHO = Echo()
'''


@pytest.fixture
def packages(tmp_path, monkeypatch):
    root = tmp_path / "site"
    (root / "myenvs").mkdir(parents=True)
    (root / "myenvs" / "__init__.py").write_text(ENVS_MODULE)
    info = root / "myenvs-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: myenvs\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[posttrain.environments]\necho = myenvs:make_echo\n")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, "myenvs", raising=False)
    return root


def test_builtin_with_options():
    found = resolve_environment("calculator", {"terms": 3})
    env = found.make()
    assert isinstance(env, CalculatorEnv) and env.terms == 3
    assert found.make() is not env  # one environment per episode
    assert found.record() == {
        "spec": "calculator",
        "kind": "builtin",
        "target": "posttrain.environments.calculator:CalculatorEnv",
    }
    assert found.demonstrates
    with pytest.raises(EnvironmentSpecError, match=r"unknown \[environment\] key 'term'; did you"):
        resolve_environment("calculator", {"term": 3}, options_name="[environment]")


def test_dotted_paths_and_entry_points(packages):
    by_class = resolve_environment("myenvs:Echo", {"word": "ok"})
    assert (by_class.kind, by_class.target) == ("path", "myenvs:Echo")
    assert by_class.make().word == "ok" and not by_class.demonstrates  # pyright: ignore[reportAttributeAccessIssue]
    by_function = resolve_environment("myenvs:make_echo")
    assert by_function.make().word == "yo"  # pyright: ignore[reportAttributeAccessIssue]
    installed = resolve_environment("echo", {"word": "hey"})
    assert (installed.kind, installed.target) == ("entry_point", "myenvs:make_echo")
    assert installed.make().word == "hey"  # pyright: ignore[reportAttributeAccessIssue]
    with pytest.raises(EnvironmentSpecError, match=r"unknown environment 'ecko'; did you mean"):
        resolve_environment("ecko")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("myenvs:make_nothing", r"make_nothing\(\) returned a dict, which is not an Environment: "
         "it lacks reset, step"),
        ("myenvs:NoStep", "class NoStep is not an Environment: it lacks step"),
        ("myenvs:ECHO", "is an environment object; name its class or a function"),
        ("myenvs:Missing", "'myenvs' has no attribute 'Missing'"),
        ("nomodule_xyz:Env", "module 'nomodule_xyz' does not import"),
        ("not a path:x", "is not a dotted path"),
    ],
)  # fmt: skip
def test_bad_specs_say_what_is_wrong(packages, spec, message):
    with pytest.raises(EnvironmentSpecError, match=message):
        resolve_environment(spec)


def _config(tmp_path, run: str, extra: str = "") -> object:
    path = tmp_path / "job.toml"
    path.write_text(f"[run]\nenvironment = {run!r}\n{extra}")
    return path


def test_the_job_names_run_environment_and_the_config_file(packages, tmp_path):
    path = _config(tmp_path, "myenvs:make_nothing")
    with pytest.raises(JobTaskError) as caught:
        resolve_job_environment(load_config(path))  # pyright: ignore[reportArgumentType]
    assert caught.value.option == "[run] environment"
    assert str(caught.value).startswith(f"[run] environment in {path}: environment ")
    assert "returned a dict, which is not an Environment" in str(caught.value)
    # [sft] examples needs demonstrations, which Echo has not.
    path = _config(tmp_path, "myenvs:Echo", "[sft]\nexamples = 4\n")
    with pytest.raises(JobTaskError, match=r"\[sft\] examples in .*has no demonstration\(\)"):
        resolve_job_environment(load_config(path))  # pyright: ignore[reportArgumentType]


def test_explain_and_doctor_resolve_the_environment(packages, tmp_path, capsys):
    path = _config(tmp_path, "calculator", "[environment]\nmax_value = 9\n[rl]\nmax_turns = 3\n")
    assert main(["explain", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["environment"] == {
        "spec": "calculator",
        "kind": "builtin",
        "target": "posttrain.environments.calculator:CalculatorEnv",
        "resolved": True,
    }
    assert "task" not in report and report["config"]["environment"] == {"max_value": 9}
    plan = report["plan"]
    assert plan["rl_sampled_tokens_per_step_max"] == 16 * 8 * 3 * 16  # episodes x turns x tokens
    assert plan["rl_prompt_tokens_per_step_estimate"] is None and plan["held_out_problems"] == 200
    assert report["plan_notes"]["rl_group_size"] == "episodes per seed"
    main(["doctor", "--config", str(path)])
    assert "PASS  environment" in capsys.readouterr().out

    bad = _config(tmp_path, "myenvs:NoStep")
    assert main(["explain", str(bad), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["environment"] == {"spec": "myenvs:NoStep", "resolved": False}
    (problem,) = report["preflight"]["problems"]
    assert problem["option"] == "[run] environment" and str(bad) in problem["message"]
    assert main(["doctor", "--config", str(bad)]) == 1
    assert "FAIL  environment" in capsys.readouterr().out
