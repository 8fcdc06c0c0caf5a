"""Jobs on your own work: a task by dotted path from a package of the test's own (killed and
resumed with `--resume` alone, bit for bit), and a dataset task with a custom reward, its bad
rollouts counted and dropped within `[rl] max_bad_rollouts`, and its data checked on resume."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from kill_resume import kill_and_resume
from safetensors.torch import load_file

from posttrain.cli.main import main
from posttrain.jobs.config import load_config
from posttrain.jobs.report import TIMING_KEYS
from posttrain.jobs.train_job import run_job

COPY_TASK = '''
import random
from dataclasses import dataclass

from posttrain.tasks import Problem


@dataclass(frozen=True)
class Copy:
    """Copy a 3-letter word; the reward is the share of letters in place (async, to show it)."""

    letters: str
    name: str = "copy"

    def make_prompts(self, rng, n):
        return [self._draw(rng) for _ in range(n)]

    def held_out(self, seed, n):
        rng = random.Random(f"held-out:{seed}")
        return [self._draw(rng) for _ in range(n)]

    async def reward(self, problem, completion, stop_reason):
        return sum(a == b for a, b in zip(completion, problem.answer)) / 3

    def solution(self, problem):
        return problem.answer

    def _draw(self, rng):
        word = "".join(rng.choice(self.letters) for _ in range(3))
        return Problem(f"copy {word}", word)


def make_task(letters="abc"):
    return Copy(letters)
'''


def _toml(tables: dict[str, dict[str, object]]) -> str:
    lines = []
    for table, values in tables.items():
        lines.append(f"[{table}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def _weights(run_dir: Path) -> dict:
    latest = max(
        (p for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()),
        key=lambda p: int(p.name),
    )
    return load_file(latest / "model.safetensors")


def _rows(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


@pytest.mark.slow
def test_a_dotted_path_task_is_killed_and_resumes_with_resume_alone(tmp_path, monkeypatch):
    """`copytasks:make_task` from a package in the test's directory, on PYTHONPATH: a
    `posttrain train` SIGKILLed after RL step 2's checkpoint, then `posttrain train CONFIG
    --resume DIR` (no launcher, nothing patched), ends with the weights, metrics and history
    of an uninterrupted run, bit for bit."""
    packages = tmp_path / "packages"
    (packages / "copytasks").mkdir(parents=True)
    (packages / "copytasks" / "__init__.py").write_text(COPY_TASK)
    tables: dict[str, dict[str, object]] = {
        "run": {"task": "copytasks:make_task", "name": "job", "project": "t", "seed": 5},
        "task": {"letters": "ab"},
        "model": {"base_model": "tiny:qwen2:tiny", "lora_rank": 0},
        "sft": {"examples": 8, "batch_size": 4, "epochs": 2, "learning_rate": 1e-3},
        "rl": {"steps": 5, "prompts_per_step": 4, "group_size": 4, "max_tokens": 6,
               "learning_rate": 1e-3},
        "eval": {"held_out": 8, "every": 2},
    }  # fmt: skip
    whole_config = tmp_path / "whole.toml"
    whole_config.write_text(
        _toml({**tables, "run": {**tables["run"], "output_dir": str(tmp_path / "a")}})
    )
    monkeypatch.syspath_prepend(str(packages))
    whole = asyncio.run(run_job(load_config(whole_config), echo=lambda _: None))

    config = tmp_path / "job.toml"
    config.write_text(
        _toml({**tables, "run": {**tables["run"], "output_dir": str(tmp_path / "b")}})
    )
    run_dir = tmp_path / "b" / "t" / "models" / "job"
    kill_and_resume(config, run_dir, cwd=tmp_path, extra_env={"PYTHONPATH": str(packages)})

    recorded = json.loads((run_dir / "job.json").read_text())
    assert recorded["resolved_task"] == {
        "spec": "copytasks:make_task",
        "kind": "path",
        "target": "copytasks:make_task",
    }
    assert recorded["task"] == {"letters": "ab"}
    a, b = _weights(whole.run_dir), _weights(run_dir)
    base = load_file(whole.run_dir / "base_model" / "model.safetensors")
    assert any(not a[key].equal(base[key]) for key in a)  # it did train
    assert a.keys() == b.keys() and all(a[key].equal(b[key]) for key in a)
    assert _rows(run_dir / "metrics.jsonl") == _rows(whole.run_dir / "metrics.jsonl")
    assert _rows(run_dir / "history.jsonl") == _rows(whole.run_dir / "history.jsonl")
    # The shaped async reward moved: RL had a signal from the first step.
    rewards = [r["reward"] for r in _rows(run_dir / "metrics.jsonl") if r["phase"] == "rl"]
    assert len(rewards) == 5 and len(set(rewards)) > 1


GRADER = '''
def graded(problem, completion, stop_reason):
    """0.5 for any completion that ends, 1 for the answer; raises on the problem marked bad."""
    if problem.info.get("bad"):
        raise ValueError("cannot grade this one")
    if stop_reason == "length":
        return 0.0
    return 1.0 if completion.strip() == problem.answer else 0.5
'''


def _dataset_job(tmp_path: Path, **rl: object) -> Path:
    """A dataset task: 4 training problems (the third marked bad), 2 held out, the grader
    beside the config, an SFT warm-up from the answers and a prompt/answer SFT file."""
    lines = [{"q": f"{a}+{b}=", "a": str(a + b), **({"bad": True} if a == 3 else {})}
             for a, b in ((1, 2), (2, 2), (3, 4), (5, 1))]  # fmt: skip
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "test.jsonl").write_text('{"q": "4+4=", "a": "8"}\n{"q": "2+5=", "a": "7"}\n')
    (tmp_path / "sft.jsonl").write_text('{"q": "1+1=", "a": "2"}\n')
    (tmp_path / "my_grader.py").write_text(GRADER)
    sys.modules.pop("my_grader", None)
    config = tmp_path / "job.toml"
    config.write_text(_toml({
        "run": {"name": "job", "project": "t", "output_dir": "runs", "seed": 1},
        "data": {"train": "train.jsonl", "held_out": "test.jsonl", "prompt_field": "q",
                 "answer_field": "a", "reward": "my_grader:graded", "system_prompt": "add"},
        "model": {"base_model": "tiny:qwen2:tiny", "lora_rank": 0},
        "sft": {"examples": 4, "dataset": "sft.jsonl", "batch_size": 5, "epochs": 1},
        "rl": {"steps": 1, "prompts_per_step": 4, "group_size": 3, "max_tokens": 4, **rl},
        "eval": {"held_out": 10},
    }))  # fmt: skip
    return config


def test_a_dataset_job_fails_on_a_bad_rollout_by_default(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the config names relative paths; a run goes under ./runs
    monkeypatch.setattr(sys, "path", list(sys.path))
    # The SFT warm-up takes the answers; each RL step draws all 4 problems (4 of 4).
    config = _dataset_job(tmp_path)
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert (
        f"reward 'my_grader:graded' raised ValueError: cannot grade this one (on the problem at "
        f"{tmp_path / 'train.jsonl'}:3, completion " in err
    )
    assert "(3 of 12 rollouts of this step failed; [rl] max_bad_rollouts = 0.0 tolerates 0)" in err


def test_a_dataset_job_drops_bad_rollouts_within_the_bound(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    config = _dataset_job(tmp_path, max_bad_rollouts=0.25)  # 3 of 12 = 0.25: tolerated
    lines: list[str] = []
    result = asyncio.run(run_job(load_config(config), echo=lines.append))
    assert "sft warm-up: 5 examples, 1 epochs" in lines  # 4 answers + 1 SFT line
    recorded = json.loads((result.run_dir / "job.json").read_text())["resolved_task"]
    assert recorded["kind"] == "data" and recorded["reward"] == "my_grader:graded"
    assert (recorded["train_problems"], recorded["held_out_problems"]) == (4, 2)
    assert set(recorded["sha256"]) == {"train", "held_out"}
    (rl,) = [r for r in _rows(result.run_dir / "metrics.jsonl") if r["phase"] == "rl"]
    assert rl["bad_rollouts"] == 3.0
    # The bad problem's rollouts were dropped whole: 9 trajectories, none of "3+4=".
    (logged,) = [r for r in _rows(result.run_dir / "history.jsonl") if "bad_rollouts" in r]
    assert logged["bad_rollouts"] == 3.0 and logged["step"] == 2  # SFT was model step 1
    saved = (result.run_dir / "trajectories" / "train").glob("*.jsonl")
    records = [json.loads(line) for path in saved for line in path.read_text().splitlines()]
    assert len(records) == 9 and {r["metadata"]["prompt"] for r in records} == {
        "1+2=",
        "2+2=",
        "5+1=",
    }
    # The prompt is the system prompt and the line's question, rendered by the chat template.
    assert records[0]["messages"][0] == {"role": "system", "content": "add"}

    # Changed data is refused on resume: the run would go on with other problems.
    (tmp_path / "train.jsonl").write_text(
        (tmp_path / "train.jsonl").read_text().replace("5+1", "5+2")
    )
    with pytest.raises(ValueError, match=r"\[data\] train: the file changed since the run started"):
        asyncio.run(run_job(load_config(config), resume=result.run_dir, echo=lambda _: None))


def test_a_reward_returning_nan_fails_the_step_naming_the_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    config = _dataset_job(tmp_path)
    (tmp_path / "nan_grader.py").write_text(
        "def graded(problem, completion, stop_reason):\n"
        "    return float('nan') if problem.answer == '2' else 0.0\n"
    )
    sys.modules.pop("nan_grader", None)
    config.write_text(config.read_text().replace("my_grader:graded", "nan_grader:graded"))
    # The held-out problems (answers 8 and 7) score 0; RL step 1 draws line 1, scored NaN.
    (tmp_path / "train.jsonl").write_text('{"q": "1+1=", "a": "2"}\n{"q": "2+1=", "a": "3"}\n')
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert (
        f"reward 'nan_grader:graded' returned NaN for the problem at {tmp_path / 'train.jsonl'}:1"
        in err
    )


def test_explain_and_doctor_read_the_dataset_as_the_job_does(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    config = _dataset_job(tmp_path)
    assert main(["explain", str(config), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    task = report["task"]
    assert (task["kind"], task["reward"], task["train_problems"], task["held_out_problems"]) == (
        "data", "my_grader:graded", 4, 2,
    )  # fmt: skip
    # [eval] held_out = 10, but the held-out file has 2; the SFT file's 1 line is read with
    # the [data] field names (q, a).
    assert report["plan"]["held_out_problems"] == 2 and report["plan"]["sft_dataset_rows"] == 1
    main(["doctor", "--config", str(config), "--storage", str(tmp_path)])
    out = capsys.readouterr().out
    assert "PASS  task" in out and "4 training / 2 held-out problems" in out
    # A line without the named field: explain, doctor and train all name the file and line.
    (tmp_path / "test.jsonl").write_text('{"question": "4+4="}\n')
    assert main(["explain", str(config)]) == 1
    expected = f"{tmp_path / 'test.jsonl'}:1: no field 'q' (prompt_field); the line has 'question'"
    assert expected in capsys.readouterr().out
    main(["doctor", "--config", str(config), "--storage", str(tmp_path)])
    assert "FAIL  task" in (out := capsys.readouterr().out) and expected in out
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"posttrain train: preflight: [data]: {expected}" in err and f"(config {config})" in err
