"""A job's `[teacher]`: on-policy distillation from a job config. The table names a model
loaded here (or a run's checkpoint) or a server; explain and preflight judge the job with it,
job.json records it (its key redacted), and each RL step reports `teacher_kl`."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import pytest

from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.cli.explain_cmd import explain
from posttrain.jobs.config import TeacherConfig, parse_config
from posttrain.jobs.run_dir import JOB_FILE, prepare_run_dir
from posttrain.jobs.teacher import build_teacher
from posttrain.jobs.train_job import run_job
from posttrain.types import ModelInput


def _job(tmp_path: Path, teacher: Mapping[str, object] | None, **rl: object):
    data: dict[str, object] = {
        "run": {"task": "reverse", "name": "student", "output_dir": str(tmp_path / "runs")},
        "model": {"lora_rank": 4},
        "rl": {"steps": 1, "prompts_per_step": 2, "group_size": 2, "max_tokens": 4, **rl},
        "eval": {"held_out": 2},
    }
    if teacher is not None:
        data["teacher"] = dict(teacher)
    return parse_config(data)


def test_the_teacher_table_names_one_source():
    for table, message in [
        ({}, "needs model .* or url"),
        ({"model": "m", "url": "http://x"}, "not both"),
        ({"model": "m", "api_key": "k"}, "api_key goes with url"),
        ({"url": "http://x"}, "url needs model_path .* or base_model"),
        ({"url": "http://x", "model_path": "tinker://a", "base_model": "b"}, "one of them"),
        ({"model": "m", "temperature": 1.0}, "unknown key 'temperature'"),
    ]:
        with pytest.raises(ValueError, match=r"^\[teacher\] .*" + message):
            _job(Path("."), table)


def test_explain_and_preflight_judge_the_job_with_its_teacher(tmp_path):
    mixed = _job(tmp_path, {"model": "tiny:qwen2:tiny:1"}, distill_reward_coef=0.5)
    report = explain(mixed)
    assert report["preflight"] == {"ok": True, "problems": []}
    assert report["config"]["teacher"]["model"] == "tiny:qwen2:tiny:1"  # pyright: ignore[reportIndexIssue]
    # [rl] shows the teacher the job distills from, as the job's train() options hold it.
    assert report["config"]["rl"]["trainer"]["teacher"] == "tiny:qwen2:tiny:1"  # pyright: ignore[reportIndexIssue]
    assert json.loads(json.dumps(report)) == report  # the --json output, unchanged
    # Without a teacher, distill_reward_coef is refused; with one, what distillation replaces.
    alone = explain(_job(tmp_path, None, distill_reward_coef=0.5))["preflight"]
    assert [p["option"] for p in alone["problems"]] == ["distill_reward_coef"]  # pyright: ignore[reportIndexIssue]
    transform = _job(tmp_path, {"model": "tiny:qwen2:tiny:1"}, token_transform="gtpo")
    options = [p["option"] for p in explain(transform)["preflight"]["problems"]]  # pyright: ignore[reportIndexIssue]
    assert options == ["token_transform"]
    missing = _job(tmp_path, {"model": str(tmp_path / "no-such-model")})
    [problem] = explain(missing)["preflight"]["problems"]  # pyright: ignore[reportIndexIssue]
    assert problem["option"] == "[teacher] model"
    served = {"url": "http://127.0.0.1:9", "base_model": "m", "api_key": "tml-SECRET"}
    shown = json.dumps(explain(_job(tmp_path, served)))
    assert "SECRET" not in shown and '"api_key": "***"' in shown


def test_job_json_records_the_teacher_and_a_resume_refuses_another(tmp_path):
    served = {"url": "http://127.0.0.1:9", "base_model": "m", "api_key": "tml-SECRET"}
    config = _job(tmp_path, served)
    run_dir = tmp_path / "run"
    prepare_run_dir(run_dir, config, resume=False)
    recorded = json.loads((run_dir / JOB_FILE).read_text())["teacher"]
    assert recorded["base_model"] == "m" and recorded["api_key"] == "***"
    moved = {**served, "url": "http://10.0.0.2:8000", "api_key": "tml-OTHER"}  # same teacher
    prepare_run_dir(run_dir, _job(tmp_path, moved), resume=True)
    with pytest.raises(ValueError, match=r"\[teacher\] base_model: 'm' in the run, 'n' now"):
        prepare_run_dir(run_dir, _job(tmp_path, {**served, "base_model": "n"}), resume=True)
    with pytest.raises(ValueError, match=r"\[teacher\]: in the run's job.json, not in the config"):
        prepare_run_dir(run_dir, replace(config, teacher=None), resume=True)


async def test_a_job_distills_from_its_teacher_and_a_checkpoint_can_teach(tmp_path):
    config = _job(tmp_path, {"model": "tiny:qwen2:tiny:1", "name": "seed-1"})
    lines: list[str] = []
    result = await run_job(config, echo=lines.append)
    assert "teacher: seed-1" in lines
    assert (result.run_dir / "teacher_model" / "config.json").is_file()
    history = [json.loads(line) for line in (result.run_dir / "history.jsonl").open()]
    [step] = [row for row in history if row["split"] == "train"]
    assert math.isfinite(step["teacher_kl"]) and step["teacher_kl"] != 0.0
    # The run's checkpoint as a teacher scores as the run's model does.
    checkpoint = result.run_dir / "checkpoints" / "1"
    teacher = build_teacher(TeacherConfig(model=str(checkpoint)), tmp_path)
    backend = LocalBackend(tmp_path / "runs")
    student = TrainableModel(
        name="student",
        project="posttrain",
        base_model=str(result.run_dir / "base_model"),
        lora_rank=4,
    )
    await student.register(backend)
    tokens = [1, 104, 101, 108, 108, 111]
    expected = await backend.sampling_client(student).compute_logprobs(ModelInput.from_ints(tokens))
    await backend.close()
    got = await teacher.logprobs(tokens)
    assert got[0] is None and got[1:] == pytest.approx(expected[1:], abs=1e-5)
