"""A `gtpo_sepa` job (on the sampler's per-token entropies) killed mid-run resumes bit for bit:
the SEPA controller's state (its step count, gate and variance EMA) is saved with each
checkpoint and restored with the weights.

Its lambda ramps over the run (sepa_steps 3, no delay, gate open, auto schedule with a
one-step warm-up), so a resume that lost the state would restart the ramp from 0 and log
other sepa_lambda values, other advantages, other weights.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from kill_resume import kill_and_resume
from safetensors.torch import load_file

from posttrain.jobs.config import parse_config
from posttrain.jobs.report import TIMING_KEYS
from posttrain.jobs.train_job import run_job
from posttrain.trainer.token_advantages import SEPA_STATE_KEY

SEPA = {
    "token_transform": "gtpo_sepa",
    "uncertainty_kind": "shannon_entropy",  # the local sampler's entropies, end to end
    "sepa_schedule": "auto",
    "sepa_steps": 3,
    "sepa_delay_steps": 0,
    "sepa_correct_rate_gate": 0.0,
    "sepa_warmup_steps": 1,
    "sepa_ema_decay": 0.5,
}


def job(output: Path, steps: int) -> dict[str, dict[str, object]]:
    return {
        "run": {"task": "reverse", "name": "job", "project": "t", "seed": 5, "output_dir": str(output)},
        "model": {"base_model": "tiny:qwen2:tiny", "lora_rank": 0},
        "sft": {"examples": 8, "batch_size": 4, "epochs": 2, "learning_rate": 1e-3},
        "rl": {"steps": steps, "prompts_per_step": 4, "group_size": 4, "max_tokens": 6,
               "learning_rate": 1e-3, **SEPA},
        "eval": {"held_out": 4, "every": 0},
    }  # fmt: skip


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    steps = [p for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()]
    return load_file(max(steps, key=lambda p: int(p.name)) / "model.safetensors")


def history(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def lambdas(run_dir: Path) -> list[float]:
    return [r["sepa_lambda"] for r in history(run_dir) if "sepa_lambda" in r]


def toml(config: dict[str, dict[str, object]]) -> str:
    lines = []
    for table, values in config.items():
        lines.append(f"[{table}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


@pytest.mark.slow
def test_a_sigkilled_gtpo_sepa_run_resumes_bit_for_bit(tmp_path):
    whole = asyncio.run(run_job(parse_config(job(tmp_path / "a", 5)), echo=lambda _: None))
    # The ramp: lambda_k = k / 3 (the auto part never exceeds it here or the values differ).
    ramp = lambdas(whole.run_dir)
    assert len(ramp) == 5 and ramp[:2] == [0.0, pytest.approx(1 / 3)] and ramp[-1] == 1.0
    state = json.loads((whole.run_dir / "checkpoints" / "6" / "trainer_state.json").read_text())
    saved = state["run_state"][SEPA_STATE_KEY]
    assert saved["steps"] == 5 and saved["gate_open"] is True and saved["var_0"] is not None

    config = tmp_path / "job.toml"
    config.write_text(toml(job(tmp_path / "b", 5)))
    run_dir = tmp_path / "b" / "t" / "models" / "job"
    kill_and_resume(config, run_dir)

    assert lambdas(run_dir) == ramp
    a, b = weights(whole.run_dir), weights(run_dir)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].equal(b[key]), key
    assert history(run_dir) == history(whole.run_dir)
