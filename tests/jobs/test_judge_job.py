"""Jobs whose reward comes from a model: the `[judge]` and `[reward_model]` tables, an LLM judge
job against the stand-in judge server (its costs in each step's row, and a resumed step that
asks the judge nothing), and a reward-model job."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from posttrain.cli.explain_cmd import key_lines
from posttrain.jobs.config import load_config, parse_config
from posttrain.jobs.train_job import JUDGE_CACHE, run_job

sys.path.insert(0, str(Path(__file__).parents[2] / "recipes"))
sys.path.insert(0, str(Path(__file__).parents[1] / "tasks"))
from judge_standin import StandinJudge  # pyright: ignore[reportMissingImports]
from test_reward_model import save_reward_model  # pyright: ignore[reportMissingImports]

JUDGE = {"base_url": "http://127.0.0.1:9/v1", "model": "m", "rubric": "r"}
DATA = {"train": "train.jsonl", "reward": "judge"}


def test_judge_tables_go_with_their_reward():
    config = parse_config({"data": DATA, "judge": {**JUDGE, "mode": "group"}})
    assert config.judge is not None and config.judge.mode == "group"
    problems = {
        r'reward = "judge" needs a \[judge\] table': {"data": DATA},
        "configures the judge": {"data": {**DATA, "reward": "exact"}, "judge": JUDGE},
        r"\[judge\] base_url is required": {"data": DATA, "judge": {**JUDGE, "base_url": ""}},
        "unknown key 'retry'.*retries": {"data": DATA, "judge": {**JUDGE, "retry": 1}},
        "mode": {"data": DATA, "judge": {**JUDGE, "mode": "pairwise"}},
        r"configures \[data\] reward = \"model:PATH\"": {
            "data": {**DATA, "reward": "exact"},
            "reward_model": {},
        },
    }
    for match, tables in problems.items():
        with pytest.raises(ValueError, match=match):
            parse_config(tables)
    model = parse_config({"data": {**DATA, "reward": "model:rm"}})
    assert model.reward_model is not None and model.reward_model.transform == "sigmoid"


def test_explain_documents_the_new_tables():
    assert key_lines("judge.mode") == [
        "[judge] mode = 'pointwise'  # pointwise: one request per completion; group: one per "
        "prompt's group"
    ]
    assert any(
        line.startswith("[reward_model] transform = 'sigmoid'")
        for line in key_lines("reward_model")
    )


def write_job(
    directory: Path, data: dict[str, object], extra: str, *, rl: str = "", held_out: int = 2
) -> Path:
    lines = [json.dumps({"prompt": w, "answer": w[::-1]}) for w in ("abc", "bca", "cab", "acb")]
    lines += [json.dumps({"prompt": w, "answer": w[::-1]}) for w in ("bac", "cba", "aab", "bba")]
    (directory / "train.jsonl").write_text("\n".join(lines) + "\n")
    table = "\n".join(f"{k} = {json.dumps(v)}" for k, v in data.items())
    text = f"""
[run]
name = "judged"
output_dir = "{directory / "runs"}"
keep_checkpoints = 3

[data]
train = "train.jsonl"
held_out_fraction = 0.3
{table}

[model]
base_model = "tiny:qwen2:tiny"

[rl]
steps = 2
prompts_per_step = 2
group_size = 4
max_tokens = 4
{rl}

[eval]
held_out = {held_out}
{extra}
"""
    (directory / "job.toml").write_text(text)
    return directory / "job.toml"


def rl_rows(run_dir: Path) -> list[dict[str, object]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if row["phase"] == "rl"]


@pytest.mark.slow
def test_a_judged_job_logs_its_costs_and_a_resumed_step_pays_nothing(
    standin: StandinJudge, tmp_path: Path
):
    judge = f'[judge]\nbase_url = "{standin.url}"\nmodel = "stand-in"\nrubric = "r"\nmode = "group"'
    config = load_config(write_job(tmp_path, {"reward": "judge"}, judge))
    result = asyncio.run(run_job(config, echo=lambda _: None, progress_bar=False))
    rows = rl_rows(result.run_dir)
    # Group mode: one request per prompt's group, 2 prompts a step, nothing cached yet.
    assert [row["judge_calls"] for row in rows] == [2, 2]
    assert [row["judge_failures"] for row in rows] == [0, 0]
    assert all(isinstance(row["judge_s"], float) and row["judge_s"] > 0 for row in rows)
    assert (result.run_dir / JUDGE_CACHE).is_file()
    asked = standin.requests  # RL steps and the evaluations before and after
    # Resume from the checkpoint after RL step 1: step 2 samples the same rollouts again (its
    # seeds and weights are restored), and the judge's cache answers every one of them.
    resumed = asyncio.run(
        run_job(config, resume=result.run_dir, resume_step=1, echo=lambda _: None)
    )
    again = rl_rows(resumed.run_dir)
    assert len(again) == 2 and again[1]["judge_calls"] == 0 and again[1]["judge_cache_hits"] == 2
    assert again[1]["reward"] == rows[1]["reward"]
    assert standin.requests == asked  # the evaluation after RL was cached too


@pytest.mark.slow
def test_judge_failures_are_bad_rollouts_of_the_step(standin: StandinJudge, tmp_path: Path):
    # One request a step: of a step's two groups one is refused, its 4 rollouts bad (the one
    # held-out problem's evaluation fits the budget).
    judge = (
        f'[judge]\nbase_url = "{standin.url}"\nmodel = "stand-in"\nrubric = "r"\n'
        'mode = "group"\nmax_calls_per_step = 1'
    )
    tolerant = write_job(
        tmp_path, {"reward": "judge"}, judge, rl="max_bad_rollouts = 0.5", held_out=1
    )
    result = asyncio.run(run_job(load_config(tolerant), echo=lambda _: None, progress_bar=False))
    rows = rl_rows(result.run_dir)
    assert [row["bad_rollouts"] for row in rows] == [4, 4]
    assert [(row["judge_calls"], row["judge_failures"]) for row in rows] == [(1, 1), (1, 1)]
    (tmp_path / "strict").mkdir()
    strict = write_job(tmp_path / "strict", {"reward": "judge"}, judge, held_out=1)
    config = load_config(strict)
    with pytest.raises(Exception, match=r"max_calls_per_step = 1 spent.*4 of 8 rollouts"):
        asyncio.run(run_job(config, echo=lambda _: None, progress_bar=False))


@pytest.mark.slow
def test_a_reward_model_job(tmp_path: Path):
    save_reward_model(tmp_path / "rm", 1)
    extra = '[reward_model]\ndevice = "cpu"\nbatch_size = 2'
    config = load_config(write_job(tmp_path, {"reward": "model:rm"}, extra))
    result = asyncio.run(run_job(config, echo=lambda _: None, progress_bar=False))
    rows = rl_rows(result.run_dir)
    # sigmoid scores: strictly inside (0, 1), and never exactly equal across a step's 8.
    assert len(rows) == 2 and all(0 < float(row["reward"]) < 1 for row in rows)  # pyright: ignore[reportArgumentType]
    job = json.loads((result.run_dir / "job.json").read_text())
    assert job["reward_model"]["batch_size"] == 2
