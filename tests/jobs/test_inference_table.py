"""The job's `[inference]` table: parsed into an InferenceConfig, given to the backend as
`inference=`, recorded in job.json (a resume keeps the engine), and refused before any work
where it cannot hold: a backend without `inference=`, devices the backend disagrees with. Its
`sync` is the server's to take at register, for a job as for the API."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import pytest
from tests.inference.test_openai_lora import LOAD, LoraStub
from tests.server.serve_helpers import KEY, start_server

from posttrain.backends.local import LocalBackend
from posttrain.inference.config import InferenceConfig
from posttrain.inference.openai_engine import OpenAIServerError
from posttrain.jobs.backend import constructor_kwargs, job_problems
from posttrain.jobs.config import JobConfig, parse_config
from posttrain.jobs.run_dir import JOB_FILE, config_changes, config_record, prepare_run_dir
from posttrain.jobs.train_job import run_job, train

TESTS = Path(__file__).parents[1]
OPENAI = {"engine": "openai", "url": "http://127.0.0.1:9/v1"}  # nothing listens: never reached


def _job(output: Path, inference: Mapping[str, object], **run: object) -> JobConfig:
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


@pytest.mark.parametrize("sync", ["auto", "none", "reload"])
def test_the_job_takes_each_sync_the_api_takes(tmp_path: Path, sync: str):
    """What the server takes decides at register, for a job as for the API (`EngineSession`):
    'auto' sends the adapter or whole weights, 'reload' whole weights, and 'none' samples the
    server's fixed policy, explicitly off-policy; preflight refuses none of them."""
    assert job_problems(_job(tmp_path, {**OPENAI, "sync": sync}))[1] == []


async def test_a_job_with_sync_auto_sends_each_steps_adapter(tmp_path: Path):
    """The openai engine's default, on a LoRA model whose adapter vLLM carries: register loads
    the adapter of step 0, and each RL step's sync a new one, as `register` does for the API."""
    stub = LoraStub()
    inference = {"engine": "openai", "url": stub.server.url, "model": "m", "parity_check": "off"}
    config = _job(tmp_path, inference)
    model = replace(config.model, lora_rank=4, train_unembed=False)  # no lm_head adapter
    try:
        await run_job(replace(config, model=model), echo=lambda line: None)
    finally:
        stub.server.stop()
    loads = [name for path, name in stub.calls() if path == LOAD]
    assert loads == ["m-posttrain-v0", "m-posttrain-v1", "m-posttrain-v2"]
    assert not [r for r in stub.server.requests if r[1] == "/collective_rpc"]  # no whole weights


@pytest.mark.slow  # a posttrain serve subprocess
async def test_the_sync_register_advises_is_one_the_job_runs(tmp_path: Path, tiny_model_dir: Path):
    """posttrain serve takes no weights (no vLLM dev mode, no runtime LoRA): register refuses
    'auto' and advises 'none', and the job with 'none' trains, off-policy, and says how far."""
    server = start_server(tiny_model_dir, tmp_path / "storage")
    try:
        inference = {"engine": "openai", "url": f"{server.url}/v1", "api_key": KEY}
        config = _job(tmp_path / "auto", inference)
        config = replace(config, model=replace(config.model, base_model=str(tiny_model_dir)))
        with pytest.raises(OpenAIServerError) as refused:
            await run_job(config, echo=lambda line: None)
        assert "set sync = 'none'" in "\n".join(refused.value.__notes__)
        fixed = replace(
            config,
            run=replace(config.run, output_dir=str(tmp_path / "none")),
            inference=replace(config.inference, sync="none"),
        )
        result = await run_job(fixed, echo=lambda line: None)
    finally:
        server.stop()
    rows = [
        json.loads(line) for line in (result.run_dir / "history.jsonl").read_text().splitlines()
    ]
    # Step k's update leaves the model k steps past the server's weights, which sampled it.
    assert [r["sampler_steps_behind"] for r in rows if r["split"] == "train"] == [1.0, 2.0]


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
