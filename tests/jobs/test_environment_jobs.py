"""Jobs on an environment: the calculator (a warm-up on its demonstrations, then multi-turn
tool episodes), killed and resumed with `--resume` alone, bit for bit; an environment by dotted
path whose failing episodes are counted and dropped within `[rl] max_bad_rollouts`; and the
config rules that go with `[run] environment`."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from kill_resume import kill_and_resume
from safetensors.torch import load_file

from posttrain.cli.main import main
from posttrain.jobs.config import load_config, parse_config
from posttrain.jobs.report import TIMING_KEYS
from posttrain.jobs.train_job import run_job
from posttrain.rollouts.task_rollouts import derive_seed


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


def _trajectories(run_dir: Path) -> list[dict]:
    paths = sorted((run_dir / "trajectories" / "train").glob("*.jsonl"))
    return [json.loads(line) for path in paths for line in path.read_text().splitlines()]


# A warm-up on 64 solved episodes teaches the tiny model the call's format well enough that
# some episodes of most steps call the tool, read its answer and get it right (seeded: the
# same steps every run), so RL has rewards that differ within groups to learn from.
CALCULATOR: dict[str, dict[str, object]] = {
    "run": {"environment": "calculator", "name": "calc", "project": "t", "seed": 5},
    "environment": {"max_value": 9, "operations": "+", "system_prompt": ""},
    "model": {"base_model": "tiny:qwen2:tiny", "lora_rank": 0},
    "sft": {"examples": 64, "batch_size": 16, "epochs": 20, "learning_rate": 1e-2},
    "rl": {"steps": 5, "prompts_per_step": 4, "group_size": 4, "max_tokens": 96,
           "max_turns": 3, "learning_rate": 1e-3},
    "eval": {"held_out": 8, "every": 2},
}  # fmt: skip


@pytest.mark.slow
def test_a_calculator_job_is_killed_and_resumes_bit_for_bit(tmp_path):
    """A `posttrain train` on the calculator SIGKILLed after RL step 2's checkpoint, then
    `posttrain train CONFIG --resume DIR`, ends with the weights, metrics, history and
    trajectories of an uninterrupted run: the episodes of a step derive from (seed, step)."""
    whole_config = tmp_path / "whole.toml"
    whole_config.write_text(
        _toml({**CALCULATOR, "run": {**CALCULATOR["run"], "output_dir": str(tmp_path / "a")}})
    )
    whole = asyncio.run(run_job(load_config(whole_config), echo=lambda _: None))

    config = tmp_path / "job.toml"
    config.write_text(
        _toml({**CALCULATOR, "run": {**CALCULATOR["run"], "output_dir": str(tmp_path / "b")}})
    )
    run_dir = tmp_path / "b" / "t" / "models" / "calc"
    # Same threads as this process, so CPU kernels sum in the same order in all three runs.
    kill_and_resume(config, run_dir, cwd=tmp_path, timeout_s=300)

    recorded = json.loads((run_dir / "job.json").read_text())
    assert recorded["resolved_environment"] == {
        "spec": "calculator",
        "kind": "builtin",
        "target": "posttrain.environments.calculator:CalculatorEnv",
    }
    assert recorded["environment"] == CALCULATOR["environment"]
    assert "resolved_task" not in recorded
    a, b = _weights(whole.run_dir), _weights(run_dir)
    assert a.keys() == b.keys() and all(a[key].equal(b[key]) for key in a)
    assert _rows(run_dir / "metrics.jsonl") == _rows(whole.run_dir / "metrics.jsonl")
    assert _rows(run_dir / "history.jsonl") == _rows(whole.run_dir / "history.jsonl")
    assert _trajectories(run_dir) == _trajectories(whole.run_dir)

    rows = _rows(run_dir / "metrics.jsonl")
    rl = [r for r in rows if r["phase"] == "rl"]
    # Steps after the kill trained too (a loss is logged only when a group's rewards differ).
    assert len(rl) == 5 and sum(r["loss"] is not None for r in rl[2:]) >= 1
    evals = [r for r in rows if r["phase"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2, 4, 5]
    assert all({"accuracy", "mean_reward"} <= set(r) for r in evals)
    episodes = _trajectories(run_dir)
    assert len(episodes) == 5 * 16
    # Episodes that called the tool, read its answer and answered: three trainable turns' worth
    # of segments (prompt, call, tool result, answer).
    tool_use = [e for e in episodes if e["metrics"]["turns"] == 2 and e["metrics"]["tool_calls"]]
    assert tool_use and all(
        [s["trainable"] for s in e["segments"]] == [False, True, False, True] for e in tool_use
    )
    assert any(e["reward"] == 1.0 for e in tool_use)


ENV_MODULE = '''
from posttrain.environments import Reset, Step


class Digits:
    """Asks for digits twice; the reward is the share of digits written. Its step raises on
    training seeds divisible by 3 (a sandbox that dies)."""

    def __init__(self, question: str = "digits?"):
        self.question = question

    def reset(self, seed, split):
        self.seed, self.split, self.turn, self.text = seed, split, 0, ""
        return Reset([{"role": "user", "content": self.question}])

    async def step(self, message):
        if self.seed % 3 == 0 and self.split == "train":
            raise RuntimeError("the sandbox died")
        self.turn += 1
        self.text += message["content"]
        if self.turn < 2:
            return Step(messages=[{"role": "user", "content": "more"}])
        return Step(reward=sum(c.isdigit() for c in self.text) / max(len(self.text), 1), done=True)

    def demonstration(self):  # forgets the assistant's turns
        return [{"role": "user", "content": self.question}]
'''


def _digits_job(tmp_path: Path, **rl: object) -> Path:
    (tmp_path / "digits_env.py").write_text(ENV_MODULE)
    sys.modules.pop("digits_env", None)
    config = tmp_path / "job.toml"
    config.write_text(_toml({
        "run": {"environment": "digits_env:Digits", "name": "d", "project": "t", "seed": 2,
                "output_dir": "runs"},
        "environment": {"question": "write digits"},
        "model": {"base_model": "tiny:qwen2:tiny", "lora_rank": 0},
        "rl": {"steps": 1, "prompts_per_step": 6, "group_size": 2, "max_tokens": 6,
               "max_turns": 2, **rl},
        "eval": {"held_out": 2},
    }))  # fmt: skip
    return config


def _failing_seeds(seed: int, step: int, prompts: int) -> int:
    return sum(derive_seed(seed, "env", step, i) % 3 == 0 for i in range(prompts))


def test_an_environment_by_dotted_path_drops_failing_episodes_within_the_bound(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)  # the config's module sits beside it; the run goes to ./runs
    monkeypatch.setattr(sys, "path", list(sys.path))
    failing = _failing_seeds(2, 0, 6)
    assert 0 < failing < 6  # the seeds have some of each (pinned by derive_seed)

    config = _digits_job(tmp_path)
    assert main(["train", str(config)]) == 2  # by default no failure is tolerated
    err = capsys.readouterr().err
    assert "environment 'digits_env:Digits', seed " in err
    assert "step raised RuntimeError: the sandbox died" in err
    assert (
        f"({2 * failing} of 12 rollouts of this step failed; [rl] max_bad_rollouts = 0.0 "
        "tolerates 0)" in err
    )

    config = _digits_job(tmp_path, max_bad_rollouts=2 * failing / 12)
    result = asyncio.run(run_job(load_config(config), echo=lambda _: None))
    recorded = json.loads((result.run_dir / "job.json").read_text())
    assert recorded["resolved_environment"] == {
        "spec": "digits_env:Digits",
        "kind": "path",
        "target": "digits_env:Digits",
    }
    assert recorded["environment"] == {"question": "write digits"}
    (rl,) = [r for r in _rows(result.run_dir / "metrics.jsonl") if r["phase"] == "rl"]
    assert rl["bad_rollouts"] == 2 * failing
    episodes = _trajectories(result.run_dir)
    assert len(episodes) == 12 - 2 * failing  # the failed ones dropped whole
    assert all(e["metadata"]["seed"] % 3 for e in episodes)
    assert all(e["messages"][0] == {"role": "user", "content": "write digits"} for e in episodes)
    assert all(sum(s["trainable"] for s in e["segments"]) == 2 for e in episodes)


def test_a_demonstration_that_cannot_be_trained_names_the_environment(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    config = _digits_job(tmp_path)
    config.write_text(config.read_text() + "[sft]\nexamples = 2\n")
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    seed = derive_seed(2, "sft", 0)
    assert (
        f"[sft] examples: environment 'digits_env:Digits', seed {seed}, demonstration: "
        "ValueError: messages has no assistant turn: nothing to train on" in err
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"run": {"environment": "calculator", "task": "reverse"}},
         r"\[run\] environment = 'calculator' and \[run\] task = 'reverse': a job trains on a "
         "task or on an environment"),
        ({"run": {"environment": "calculator"}, "task": {"x": 1}}, r"and \[task\]"),
        ({"environment": {"terms": 3}}, r"\[environment\] holds an environment's arguments, but"),
        ({"rl": {"max_turns": 3}}, r"\[rl\] max_turns limits an environment's episodes"),
        ({"run": {"environment": "calculater"}}, r"unknown environment 'calculater'; did you mean"),
        ({"run": {"environment": "calculator"}, "rl": {"max_turns": 0}},
         r"\[rl\] max_turns must be >= 1"),
        ({"run": {"environment": "calculator"}, "environment": {"terms": {"a": 1}}},
         r"\[environment\] terms must be a value"),
    ],
)  # fmt: skip
def test_environment_config_errors_name_the_fix(data, message):
    with pytest.raises(ValueError, match=message):
        parse_config(data)
