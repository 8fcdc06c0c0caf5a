"""The train job's `[dpo]` table: one train_dpo call on a JSONL file of pairs after the warm-up,
logged and checkpointed; and its errors (bad lines, unknown keys)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from posttrain.cli.explain_cmd import explain
from posttrain.jobs.backend import job_problems
from posttrain.jobs.config import JobConfig, parse_config
from posttrain.jobs.run_dir import JOB_FILE, prepare_run_dir
from posttrain.jobs.train_job import dpo_options, run_job
from posttrain.rollouts.dpo_data import load_preference_pairs

LINES = [
    {"prompt": "abc", "chosen": "cba", "rejected": "abc"},
    {"messages": [{"role": "user", "content": "xyz"}], "chosen": "zyx", "rejected": "xzy"},
    {"prompt": "hello", "chosen": "olleh", "rejected": "hello"},
]


def _write(path: Path, lines: list[object]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _config(output: Path, data: Path, **dpo: object) -> JobConfig:
    return parse_config(
        {
            "run": {"task": "reverse", "name": "job", "project": "t", "output_dir": str(output)},
            "model": {"base_model": "tiny:qwen2:tiny", "lora_rank": 0},
            "dpo": {"data": str(data), "learning_rate": 1e-2, "batch_size": 2, **dpo},
            "rl": {"steps": 1, "prompts_per_step": 2, "group_size": 2, "max_tokens": 4},
            "eval": {"held_out": 2},
        }
    )


async def test_a_job_with_dpo_trains_logs_and_checkpoints_it(tmp_path):
    data = _write(tmp_path / "pairs.jsonl", LINES)
    lines: list[str] = []
    result = await run_job(_config(tmp_path / "out", data, epochs=2, beta=0.2), echo=lines.append)
    rows = [json.loads(r) for r in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    dpo = [r for r in rows if r["phase"] == "dpo"]
    assert len(dpo) == 1 and dpo[0]["step"] == 1
    assert {"loss", "rewards/accuracy", "rewards/margin"} <= set(dpo[0])
    assert [r["step"] for r in rows if r["phase"] == "rl"] == [1]
    assert any(line.startswith("dpo: 3 pairs, 2 epochs") for line in lines)
    assert (result.run_dir / "checkpoints" / "1").is_dir()  # the DPO step's
    state = json.loads((result.run_dir / "checkpoints" / "2" / "trainer_state.json").read_text())
    assert state["run_state"]["dpo_done"] is True


def test_pairs_file_errors_name_the_line(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(load_preference_pairs(_write(tmp_path / "ok.jsonl", LINES), tokenizer)) == 3
    bad = _write(
        tmp_path / "bad.jsonl", [LINES[0], {"prompt": "a", "chosen": "b", "rejected": "b"}]
    )
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*identical"):
        load_preference_pairs(bad, tokenizer)
    missing = _write(tmp_path / "m.jsonl", [{"prompt": "a", "chosen": "b"}])
    with pytest.raises(ValueError, match=r"m.jsonl:1: field 'rejected' must be a string"):
        load_preference_pairs(missing, tokenizer)


def test_dpo_table_errors(tmp_path):
    with pytest.raises(ValueError, match=r"\[dpo\] unknown key 'bta'; did you mean 'beta'"):
        _config(tmp_path, tmp_path / "p.jsonl", bta=0.1)
    with pytest.raises(ValueError, match=r"\[dpo\] .*option loss="):
        _config(tmp_path, tmp_path / "p.jsonl", loss="hinge")
    with pytest.raises(ValueError, match=r"\[dpo\] needs data"):
        parse_config({"dpo": {"beta": 0.1}})


def test_a_dpo_value_written_reaches_the_backend_or_is_refused(tmp_path):
    """`reference = "base"` is DPOConfig's default, but TinkerBackend's reference is the
    policy at the start of the call: written, it must reach train_dpo or be refused, never be
    dropped as "the default"."""
    config = _config(tmp_path, tmp_path / "p.jsonl", reference="base")
    assert config.dpo is not None and config.dpo.written >= {"reference", "batch_size"}
    assert dpo_options(config.dpo) == {"reference": "base", "learning_rate": 1e-2, "batch_size": 2}
    unwritten = _config(tmp_path, tmp_path / "p.jsonl")
    assert unwritten.dpo is not None and "reference" not in dpo_options(unwritten.dpo)
    lora = replace(config.model, lora_rank=8)
    tinker = replace(config, run=replace(config.run, backend="tinker"), model=lora)
    _, problems = job_problems(tinker, base_model=False)
    assert [(p.call, p.option) for p in problems] == [("train_dpo", "reference")]
    assert "TinkerBackend.train_dpo() does not take this option (set to 'base')" in str(problems[0])
    quiet = replace(unwritten, run=tinker.run, model=lora)
    assert job_problems(quiet, base_model=False)[1] == []
    shown: Any = explain(tinker)["config"]
    assert shown["dpo"]["written"] == ["batch_size", "learning_rate", "reference"]


def test_job_json_records_dpo_and_a_resume_refuses_a_change(tmp_path):
    """job.json keeps [dpo] with the sha256 of its data file, so --resume refuses another beta,
    another file's bytes, or [dpo] added or removed; the file's path may change."""
    data = _write(tmp_path / "pairs.jsonl", LINES)
    config = _config(tmp_path / "out", data, beta=0.2)
    run_dir = tmp_path / "run"
    prepare_run_dir(run_dir, config, resume=False)
    recorded = json.loads((run_dir / JOB_FILE).read_text())["dpo"]
    assert recorded["beta"] == 0.2 and recorded["batch_size"] == 2
    assert recorded["data_sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    prepare_run_dir(run_dir, config, resume=True)  # unchanged
    moved = _write(tmp_path / "moved.jsonl", LINES)
    prepare_run_dir(run_dir, _config(tmp_path / "out", moved, beta=0.2), resume=True)
    with pytest.raises(ValueError, match=r"\[dpo\] beta: 0.2 in the run, 0.3 now"):
        prepare_run_dir(run_dir, _config(tmp_path / "out", data, beta=0.3), resume=True)
    _write(data, LINES[:2])
    with pytest.raises(ValueError, match=r"\[dpo\] data: the file changed since the run started"):
        prepare_run_dir(run_dir, config, resume=True)
    without = replace(config, dpo=None)
    with pytest.raises(ValueError, match=r"\[dpo\]: in the run's job.json, not in the config"):
        prepare_run_dir(run_dir, without, resume=True)
    bare = tmp_path / "bare"
    prepare_run_dir(bare, without, resume=False)
    assert json.loads((bare / JOB_FILE).read_text())["dpo"] is None
    with pytest.raises(ValueError, match=r"\[dpo\]: not in the run's job.json, in the config"):
        prepare_run_dir(bare, config, resume=True)
    # A job.json written before [dpo] was recorded says nothing either way: no refusal.
    saved = json.loads((bare / JOB_FILE).read_text())
    del saved["dpo"]
    (bare / JOB_FILE).write_text(json.dumps(saved))
    prepare_run_dir(bare, config, resume=True)
