"""`posttrain explain` on every shipped example config, and on one preflight must refuse."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest

from posttrain.cli.main import main

EXAMPLES = sorted(Path(str(resources.files("posttrain") / "examples")).glob("*.toml"))


def test_there_are_examples():
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("config", EXAMPLES, ids=lambda p: p.stem)
def test_explain_every_example(config, capsys):
    assert main(["explain", str(config), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["preflight"] == {"ok": True, "problems": []}
    assert report["backend"]["capabilities"]["supports_sft"] is True
    plan = report["plan"]
    assert plan["rl_completions_per_step"] == plan["rl_prompts_per_step"] * plan["rl_group_size"]
    assert report["config"]["rl"]["trainer"]["learning_rate"] > 0


def test_explain_reports_preflight_problems(tmp_path, capsys):
    config = tmp_path / "bad.toml"
    config.write_text('[run]\ntask = "reverse"\n[rl]\ntruncated_importance_sampling = 2.0\n')
    assert main(["explain", str(config)]) == 1
    out = capsys.readouterr().out
    assert "truncated_importance_sampling: needs precalculate_logprobs" in out
    assert "rl_completions_per_step" in out


def test_train_runs_preflight_before_any_work(tmp_path, capsys):
    config = tmp_path / "bad.toml"
    config.write_text(f'[run]\ntask = "reverse"\noutput_dir = "{tmp_path}/runs"\n[rl]\nkl_estimator = "k1"\n')
    assert main(["train", str(config)]) == 2
    assert "kl_estimator: has no effect with kl_penalty_coef=0" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
