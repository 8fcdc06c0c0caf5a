"""A job on a verifiers environment: `[run] environment = "verifiers:<taskset id>"` with its
verifiers env config in `[environment]`, played through the job's own OpenAI endpoint; and the
config rules that go with it."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import pytest

from posttrain.jobs.config import load_config, parse_config
from posttrain.jobs.train_job import run_job

HERE = Path(__file__).parent

JOB = """
[run]
environment = "verifiers:lowercase_job_env"
name = "vf"
project = "t"
output_dir = "runs"

[environment]                      # verifiers' env config, as vf-eval's [env] table
agent = { runtime = { type = "subprocess" } }

[model]
base_model = "tiny:qwen2:tiny"
lora_rank = 0

[rl]
steps = 3
prompts_per_step = 3
group_size = 4
max_tokens = 8
learning_rate = 5e-2

[eval]
held_out = 1
"""


@pytest.mark.slow  # three RL steps of 12 episodes and two evaluations (a few seconds)
async def test_a_job_trains_a_verifiers_environment(tmp_path: Path):
    # A taskset module beside the config imports from there, as a dotted path's would.
    shutil.copy(HERE / "verifiers_lowercase.py", tmp_path / "lowercase_job_env.py")
    (tmp_path / "job.toml").write_text(JOB.replace('"runs"', json.dumps(str(tmp_path / "runs"))))
    result = await run_job(load_config(tmp_path / "job.toml"), echo=lambda _: None)

    recorded = json.loads((result.run_dir / "job.json").read_text())
    assert recorded["resolved_environment"] == {
        "spec": "verifiers:lowercase_job_env",
        "kind": "verifiers",
        "target": "lowercase_job_env:LowercaseTaskset",
    }
    rows = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert len(rl) == 3 and all(r["bad_rollouts"] == 0 for r in rl)
    evals = [r for r in rows if r["phase"] == "eval"]
    assert [r["step"] for r in evals] == [0, 3] and all("mean_reward" in r for r in evals)
    paths = sorted((result.run_dir / "trajectories" / "train").glob("*.jsonl"))
    episodes = [json.loads(line) for path in paths for line in path.read_text().splitlines()]
    assert len(episodes) == 3 * 12
    assert all([s["trainable"] for s in e["segments"]] == [False, True] for e in episodes)
    # One task is held out (by [eval] seed); the steps draw from the other three only.
    assert len({e["metadata"]["task"] for e in episodes}) == 3


def test_verifiers_environment_config_rules():
    job = tomllib.loads(JOB)
    with pytest.raises(ValueError, match=r"\[rl\] max_turns has no effect on a verifiers"):
        parse_config({**job, "rl": {**job["rl"], "max_turns": 2}})
    with pytest.raises(ValueError, match="name the verifiers taskset"):
        parse_config({**job, "run": {**job["run"], "environment": "verifiers:"}})


def test_a_job_bounds_an_endless_taskset_and_names_its_seat():
    """An endless taskset on a seat named `player` (verifiers_arena.py, as verifiers' own
    TextArena): the job's [environment] takes the seat by its name and bounds the taskset with
    `select`, and the job holds out and trains on the tasks that leaves."""
    from posttrain.jobs.backend import environment_problems
    from posttrain.jobs.work import VerifiersWork

    arena = {
        "run": {"environment": "verifiers:verifiers_arena"},
        "environment": {"player": {"runtime": {"type": "subprocess"}}, "select": {"limit": 4}},
        "eval": {"held_out": 1},
    }
    config = parse_config(arena, source=HERE / "job.toml")
    resolved, problems = environment_problems(config)
    assert problems == [] and resolved is not None
    work = VerifiersWork(resolved, config, model=None)  # pyright: ignore[reportArgumentType]  # never played
    assert work.held_out == 1 and len(work.train_tasks) == 3
    endless = {**arena, "environment": {"player": {"runtime": {"type": "subprocess"}}}}
    _, problems = environment_problems(parse_config(endless, source=HERE / "job.toml"))
    assert "select = { limit = N }" in str(problems[0])
