"""The job's `[inference]` table: parsed into an InferenceConfig, given to the backend as
`inference=`, recorded in job.json (a resume keeps the engine), and refused before any work
where it cannot hold: a backend without `inference=`, an engine that never takes new weights."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from posttrain.backends.local import LocalBackend
from posttrain.inference.config import InferenceConfig
from posttrain.jobs.backend import JobPreflightError, constructor_kwargs, job_problems
from posttrain.jobs.config import JobConfig, parse_config
from posttrain.jobs.run_dir import JOB_FILE, config_changes, config_record, prepare_run_dir
from posttrain.jobs.train_job import run_job, train

TESTS = Path(__file__).parents[1]
OPENAI = {"engine": "openai", "url": "http://127.0.0.1:9/v1"}  # nothing listens: never reached


def _job(output: Path, inference: dict[str, object], **run: object) -> JobConfig:
    return parse_config(
        {
            "run": {"task": "reverse", "name": "job", "output_dir": str(output), **run},
            "model": {"base_model": "tiny:qwen2:tiny", "lora_rank": 0},
            "rl": {"steps": 2, "prompts_per_step": 2, "group_size": 2, "max_tokens": 4},
            "eval": {"held_out": 2},
            "inference": inference,
        }
    )


def test_the_table_is_an_inference_config():
    assert parse_config({}).inference == InferenceConfig()
    config = parse_config({"inference": {"devices": "cpu,cpu", "threads": 1}})
    assert config.inference == InferenceConfig(devices="cpu,cpu", threads=1)


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"engin": "vllm"}, r"unknown \[inference\] key 'engin'; did you mean 'engine'\?"),
        ({"threads": "2"}, r"\[inference\] option threads='2' is invalid: expected int"),
        ({"engine": "vlm"}, r"\[inference\] option engine='vlm' .*did you mean 'vllm'\?"),
        ({"engine": "openai"}, r"\[inference\] engine = 'openai' needs url"),
        ({"devices": {"sampler": "cpu"}}, r"\[inference\] devices must be a value, got a table"),
    ],
)
def test_a_wrong_key_or_value_names_it(table: dict[str, object], message: str):
    with pytest.raises(ValueError, match=message):
        parse_config({"inference": table})


def test_an_unknown_key_fails_the_job_before_it_starts(tmp_path: Path):
    toml = tmp_path / "job.toml"
    toml.write_text(f'[run]\noutput_dir = "{tmp_path}"\n[inference]\nthread = 2\n')
    with pytest.raises(ValueError, match=r"unknown \[inference\] key 'thread'; did you mean"):
        train(toml)
    assert not (tmp_path / "posttrain").exists()


def test_the_backend_gets_it_as_inference(tmp_path: Path):
    split = _job(tmp_path, {"devices": "cpu,cpu", "threads": 1})
    kwargs = constructor_kwargs(split, LocalBackend, tmp_path)
    assert kwargs["inference"] == InferenceConfig(devices="cpu,cpu", threads=1)
    # The default is not passed: a backend's own default holds.
    assert "inference" not in constructor_kwargs(_job(tmp_path, {}), LocalBackend, tmp_path)
    with pytest.raises(ValueError, match=r"\[backend\] inference: the job sets it from the "):
        constructor_kwargs(parse_config({"backend": {"inference": "vllm"}}), LocalBackend, tmp_path)


def test_an_engine_keeps_a_version_for_each_step_sampled_ahead(tmp_path: Path):
    """max_off_policy_steps N: samples of N steps may be in flight on older versions, so the
    engine keeps N + 2 (at least 3, the default); keep_versions set by hand wins."""
    kept = {}
    for ahead in (0, 1, 2, 4):
        config = _job(tmp_path, {"devices": "cpu,cpu"})
        config = replace(config, rl=replace(config.rl, max_off_policy_steps=ahead))
        inference = constructor_kwargs(config, LocalBackend, tmp_path)["inference"]
        assert isinstance(inference, InferenceConfig)
        kept[ahead] = inference.versions_kept()
    assert kept == {0: 3, 1: 3, 2: 4, 4: 6}
    config = _job(tmp_path, {"devices": "cpu,cpu", "keep_versions": 2})
    config = replace(config, rl=replace(config.rl, max_off_policy_steps=4))
    inference = constructor_kwargs(config, LocalBackend, tmp_path)["inference"]
    assert isinstance(inference, InferenceConfig) and inference.versions_kept() == 2
    with pytest.raises(ValueError, match=r"keep_versions must be >= 2"):
        InferenceConfig(keep_versions=1)


def test_a_backend_without_inference_is_a_problem(tmp_path: Path, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS / "backends"))
    config = _job(tmp_path, {"devices": "cpu,cpu"}, backend="plugin_example:LocalPlugin")
    _, problems = job_problems(config)
    assert [str(p) for p in problems] == [
        "[inference]: backend 'plugin_example:LocalPlugin' (LocalPlugin) chooses its own "
        "sampling: its constructor takes no inference=, so [inference] would be ignored; "
        "remove [inference], or use backend 'local' or 'ray'"
    ]
    # At its default, [inference] asks nothing of the backend.
    assert job_problems(_job(tmp_path, {}, backend="plugin_example:LocalPlugin"))[1] == []


def test_split_devices_must_fit_the_backend(tmp_path: Path):
    ray = _job(tmp_path, {"devices": "cpu,cpu"}, backend="ray")
    assert [(p.option, p.message.split(";")[0]) for p in job_problems(ray)[1]] == [
        ("[inference] devices", "RayBackend places its workers with [backend] resources_per_worker")
    ]
    split = {"devices": "cuda:0,cuda:1"}
    local = parse_config({"backend": {"device": "cpu"}, "inference": split})
    assert [str(p) for p in job_problems(local)[1]] == [
        "[inference] devices: LocalBackend(device='cpu') and inference devices='cuda:0,cuda:1' "
        "(trainer on 'cuda:1') disagree; set one of them"
    ]


async def test_an_engine_that_never_takes_new_weights_is_refused_before_any_work(tmp_path: Path):
    for sync in ({}, {"sync": "none"}):
        with pytest.raises(JobPreflightError, match=r'set \[inference\] sync = "reload"') as info:
            await run_job(_job(tmp_path, {**OPENAI, **sync}), echo=lambda line: None)
        assert [p.option for p in info.value.problems] == ["[inference] sync"]
    assert not (tmp_path / "posttrain").exists()  # nothing written, no server asked
    # "reload" takes each step's weights; evaluation alone ([rl] steps = 0) trains nothing.
    assert job_problems(_job(tmp_path, {**OPENAI, "sync": "reload"}))[1] == []
    evaluation = parse_config({"rl": {"steps": 0}, "inference": OPENAI})
    assert job_problems(evaluation)[1] == []


def test_job_json_records_it_and_a_resume_keeps_the_engine(tmp_path: Path):
    split = _job(tmp_path, {"devices": "cpu,cpu", "threads": 1, "engine": "pytorch"})
    run_dir = prepare_run_dir(tmp_path / "run", split, resume=False)
    saved = json.loads((run_dir / JOB_FILE).read_text())
    assert saved["inference"]["devices"] == "cpu,cpu" and saved["inference"]["api_key"] is None
    # Where and how the engine runs may change on resume; which engine samples may not.
    moved = _job(tmp_path, {"devices": "cpu,cpu", "threads": 4})
    assert config_changes(saved, config_record(moved)) == []
    assert config_changes(saved, config_record(_job(tmp_path, {}))) == []  # devices, threads
    other = config_record(_job(tmp_path, {"dtype": "bfloat16"}))
    assert config_changes(saved, other) == [
        "[inference] dtype: 'float32' in the run, 'bfloat16' now"
    ]
    # A run from before [inference] sampled with the default engine.
    del saved["inference"]
    assert config_changes(saved, config_record(_job(tmp_path, {}))) == []
    assert config_changes(saved, config_record(_job(tmp_path, {**OPENAI, "sync": "reload"}))) == [
        "[inference] engine: not in the run's job.json, 'openai' now",
        "[inference] sync: not in the run's job.json, 'reload' now",
    ]


def test_the_api_key_is_never_written(tmp_path: Path):
    config = _job(tmp_path, {**OPENAI, "sync": "reload", "api_key": "sk-SECRET"})
    run_dir = prepare_run_dir(tmp_path / "run", config, resume=False)
    text = (run_dir / JOB_FILE).read_text()
    assert "SECRET" not in text and json.loads(text)["inference"]["api_key"] == "***"
