"""A job's `[rl] loss` takes what `train(loss=)` takes: a custom loss by its entry-point (or
registered) name, or by dotted path ("pkg.module:function", from beside the config file as
tasks and rewards are), on every backend whose loss option admits a LossName."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tests.clients.custom_losses import loss_distribution

from posttrain.clients import custom_loss as registry
from posttrain.jobs.backend import job_problems
from posttrain.jobs.config import parse_config
from posttrain.jobs.train_job import run_job

# REINFORCE on the sampled tokens: −Σ advantage·logprob.
LOSS_MODULE = """
import torch


def reinforce(data, logprobs):
    loss = sum(
        (-(d.loss_fn_inputs["advantages"] * lp).sum() for d, lp in zip(data, logprobs)),
        torch.tensor(0.0),
    )
    return loss, {"reinforce_calls:sum": 1.0}
"""


def _job(tmp_path: Path, loss: str, backend: str = "local"):
    rl = {"steps": 1, "prompts_per_step": 2, "group_size": 2, "max_tokens": 4, "loss": loss}
    data = {
        "run": {"task": "reverse", "backend": backend, "output_dir": str(tmp_path / "runs")},
        "model": {"lora_rank": 4},
        # An untrained model's groups all score 0: kept, so the step runs the loss.
        "rl": {**rl, "zero_variance_groups": "keep"},
        "eval": {"held_out": 2},
    }
    return parse_config(data, source=tmp_path / "job.toml")


@pytest.fixture
def entry_point_loss(tmp_path, monkeypatch):
    """`weighted_sum` in the posttrain.losses entry-point group of a stand-in distribution."""
    site = loss_distribution(
        tmp_path / "site", "weighted_sum = custom_losses:weighted_logprob_sum\n"
    )
    clients = Path(__file__).parents[1] / "clients"
    monkeypatch.setattr(sys, "path", [str(site), str(clients), *sys.path])
    monkeypatch.setattr(registry, "_registered", dict(registry._registered))
    registry._entry_points.cache_clear()
    yield "weighted_sum"
    registry._entry_points.cache_clear()


@pytest.mark.parametrize("backend", ["local", "tinker"])
def test_an_entry_point_loss_passes_preflight(tmp_path, entry_point_loss, backend):
    _, problems = job_problems(_job(tmp_path, entry_point_loss, backend), base_model=False)
    assert problems == []


def test_a_dotted_path_loss_loads_from_beside_the_config(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "_registered", dict(registry._registered))
    (tmp_path / "job_losses_ok.py").write_text(LOSS_MODULE)
    job = _job(tmp_path, "job_losses_ok:reinforce")
    assert job.rl.trainer.loss_fn == "job_losses_ok:reinforce"
    assert job_problems(job, base_model=False)[1] == []
    (tmp_path / "job_losses_bad.py").write_text("import no_such_module_here\n")
    _, problems = job_problems(_job(tmp_path, "job_losses_bad:reinforce"), base_model=False)
    assert [(p.call, p.option) for p in problems] == [("train", "loss")]
    assert "module 'job_losses_bad' does not import: ModuleNotFoundError" in problems[0].message
    _, problems = job_problems(_job(tmp_path, "job_losses_ok:missing"), base_model=False)
    assert "has no attribute 'missing'" in problems[0].message


async def test_a_job_trains_with_a_dotted_path_loss(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "_registered", dict(registry._registered))
    (tmp_path / "job_losses_run.py").write_text(LOSS_MODULE)
    result = await run_job(_job(tmp_path, "job_losses_run:reinforce"), echo=lambda _: None)
    history = [json.loads(line) for line in (result.run_dir / "history.jsonl").open()]
    [step] = [row for row in history if row["split"] == "train" and "reinforce_calls" in row]
    assert step["reinforce_calls"] >= 1.0
