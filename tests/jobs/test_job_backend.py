"""A job config names its backend (built-in, entry point or dotted path) and its constructor
options; the job builds it through the registry, checks it before any work, and trains with it."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from posttrain.backends.local import LocalBackend
from posttrain.backends.plugins.registry import describe
from posttrain.jobs.backend import JobPreflightError, call_options, constructor_kwargs, job_problems
from posttrain.jobs.config import parse_config
from posttrain.jobs.train_job import run_job
from posttrain.trainer.config import RLConfig, from_options

TESTS = Path(__file__).parents[1]
PLUGIN = "plugin_example:LocalPlugin"


@pytest.fixture(autouse=True)
def plugin_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS / "backends"))


def _job(tmp_path: Path, backend: str = PLUGIN, table: dict | None = None, **rl: object):
    data = {
        "run": {
            "task": "reverse",
            "name": "job",
            "output_dir": str(tmp_path / "runs"),
            "backend": backend,
        },
        "model": {"base_model": "tiny:qwen2:tiny", "lora_rank": 0},
        "sft": {"examples": 4, "batch_size": 4, "learning_rate": 1e-3},
        "rl": {
            "steps": 1,
            "prompts_per_step": 2,
            "group_size": 2,
            "max_tokens": 4,
            "learning_rate": 1e-3,
            **rl,
        },
        "eval": {"held_out": 2},
    }
    if table is not None:
        data["backend"] = table
    return parse_config(data)


def test_backend_names_resolve_or_list_the_known_ones():
    for name in ("local", "ray", "tinker", PLUGIN):
        assert parse_config({"run": {"backend": name}}).run.backend == name
    with pytest.raises(
        ValueError,
        match=r"^\[run\] unknown backend 'rey'; did you mean 'ray'\? \(known backends: local, ray, tinker;",
    ):
        parse_config({"run": {"backend": "rey"}})
    with pytest.raises(ValueError, match=r"\[run\] backend 'pkg\.mod:' is not a dotted path"):
        parse_config({"run": {"backend": "pkg.mod:"}})
    with pytest.raises(ValueError, match=r"\[backend\] retries must be a value, got a table"):
        parse_config({"backend": {"retries": {"n": 1}}})


def test_constructor_options_are_checked_against_the_constructor(tmp_path):
    path = tmp_path / "runs"
    kwargs = constructor_kwargs(_job(tmp_path, "local", {"num_workers": 2}), LocalBackend, path)
    assert kwargs == {"path": path, "keep_checkpoints": 2, "num_workers": 2}
    cases = [
        (
            {"num_worker": 2},
            r"\[backend\] unknown key 'num_worker' for backend 'local'; did you mean 'num_workers'\? \(its constructor takes: device, num_workers, micro_batch_tokens, gradient_checkpointing\)",
        ),
        ({"num_workers": "2"}, r"\[backend\] option num_workers='2' is invalid: expected int"),
        (
            {"path": "elsewhere"},
            r"\[backend\] path: the job sets it from \[run\] output_dir; set it there instead",
        ),
        (
            {"keep_checkpoints": 5},
            r"\[backend\] keep_checkpoints: the job sets it from \[run\] keep_checkpoints",
        ),
    ]
    for table, message in cases:
        with pytest.raises(ValueError, match=message):
            constructor_kwargs(_job(tmp_path, "local", table), LocalBackend, path)


def test_job_problems_name_the_key_and_the_fix(tmp_path):
    found, problems = job_problems(_job(tmp_path, table={"micro_batch_tokens": 4096}))
    assert found is not None and found.info.capabilities_source == "hook" and problems == []
    assert found.kwargs == {
        "path": tmp_path / "runs",
        "keep_checkpoints": 2,
        "micro_batch_tokens": 4096,
    }
    _, problems = job_problems(
        _job(tmp_path, table={"micro_batch": 1}, num_minibatches=2, loss="gspo")
    )
    assert [(p.call, p.option) for p in problems] == [
        ("backend", "[backend]"),
        ("train", "loss"),
        ("train", "num_minibatches"),
    ]
    _, problems = job_problems(_job(tmp_path, "plugin_example:PlainBackend"))
    assert "cannot sample (supports_sampling=false)" in str(problems[0])
    # No schema: every option set away from its default is refused, in each call.
    assert [(p.call, p.option) for p in problems[1:]] == [
        ("train", "learning_rate"),
        ("train_sft", "train_sft"),  # supports_sft=false
        ("train_sft", "learning_rate"),
        ("train_sft", "batch_size"),
    ]
    _, problems = job_problems(_job(tmp_path, "plugin_example:BrokenBackend"))
    assert [(p.call, p.option) for p in problems] == [("backend", "[run] backend")]
    assert "posttrain_capabilities() returned malformed capabilities" in problems[0].message


def test_call_options_are_the_declared_ones():
    declared = describe(PLUGIN).train_options
    assert call_options(from_options(RLConfig, dict(learning_rate=3e-4)), declared) == {
        "learning_rate": 3e-4,
        "loss": "cispo",  # ART's default loss
        "kimi_k2_tau": None,
        "save_checkpoint": True,
    }


async def test_a_job_runs_through_a_plugin_named_in_its_config(tmp_path):
    plugin = importlib.import_module("plugin_example").LocalPlugin

    plugin.calls.clear()
    config = _job(tmp_path, table={"micro_batch_tokens": 4096})
    result = await run_job(config, echo=lambda _: None)
    # The plugin was built with the [backend] option and the job's path, and did the training:
    # register, one SFT call and one RL call, each with exactly the options it declares.
    assert plugin.calls == [
        "register",
        "train_sft ['batch_size', 'epochs', 'learning_rate', 'lr_schedule', 'save_checkpoint']",
        "train ['kimi_k2_tau', 'learning_rate', 'loss', 'save_checkpoint']",
    ]
    assert result.run_dir == tmp_path / "runs" / "posttrain" / "models" / "job"
    # Model step 1 is the SFT call, step 2 the RL step; both checkpointed by the wrapped backend.
    assert sorted(p.name for p in (result.run_dir / "checkpoints").iterdir()) == ["1", "2"]
    rows = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert [r["phase"] for r in rows if r["phase"] != "eval"] == ["sft", "rl"]


async def test_a_plugin_gets_no_option_it_does_not_declare_and_is_described_once(tmp_path):
    """KeyedPlugin declares no save_checkpoint: the job passes none (its calls checkpoint by
    default), resolves and checks it once, and keeps its api_key out of every file it writes."""
    plugin = importlib.import_module("plugin_example").KeyedPlugin
    plugin.hook_calls.clear()
    describe("plugin_example:KeyedPlugin")
    per_describe = len(plugin.hook_calls)
    assert per_describe > 0
    plugin.calls.clear()
    plugin.hook_calls.clear()
    config = _job(tmp_path, "plugin_example:KeyedPlugin", {"api_key": "tml-SECRET"})
    result = await run_job(config, echo=lambda _: None)
    assert plugin.calls == [
        "register",
        "train_sft ['batch_size', 'epochs', 'learning_rate', 'lr_schedule']",
        "train ['kimi_k2_tau', 'learning_rate', 'loss']",
    ]
    assert len(plugin.hook_calls) == per_describe  # job_problems found it; nothing again
    assert sorted(p.name for p in (result.run_dir / "checkpoints").iterdir()) == ["1", "2"]
    written = [p for p in result.run_dir.rglob("*") if p.is_file()]
    assert [p.name for p in written if b"SECRET" in p.read_bytes()] == []
    assert json.loads((result.run_dir / "job.json").read_text())["backend"] == {"api_key": "***"}


async def test_a_refused_job_writes_nothing(tmp_path):
    with pytest.raises(
        JobPreflightError, match=r"train\(\) kimi_k2_tau: kimi_k2_tau shifts each token's advantage"
    ):
        await run_job(_job(tmp_path, kimi_k2_tau=0.2), echo=lambda _: None)
    assert not (tmp_path / "runs").exists()
