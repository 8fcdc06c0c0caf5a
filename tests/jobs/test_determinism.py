"""The same job with the same seed gives the same bits at 2 threads, not only at 1.

The suite runs with OMP_NUM_THREADS=1, where bit-exact resume holds trivially; a user's default
run uses every core. This runs one short job twice with torch at 2 threads and compares the
checkpoints and the logged metrics.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.jobs.config import JobConfig, parse_config
from posttrain.jobs.report import TIMING_KEYS
from posttrain.jobs.train_job import run_job


def _config(output: Path) -> JobConfig:
    # The mini model with 48 SFT rows in one batch: all rows share the chat template's prompt
    # prefix, so the shared-prefix pass repeats its keys/values over 48 rows (48 x 2 heads x
    # ~20 tokens x 32 dims > ATen's 32768-element grain), the case whose backward raced.
    return parse_config(
        {
            "run": {"task": "reverse", "name": "det", "project": "t", "output_dir": str(output)},
            "model": {"base_model": "tiny:qwen2:mini", "lora_rank": 0},
            "sft": {"examples": 48, "batch_size": 48, "epochs": 3, "learning_rate": 1e-3},
            "rl": {
                "steps": 2,
                "prompts_per_step": 6,
                "group_size": 8,
                "max_tokens": 8,
                "learning_rate": 1e-3,
            },
            "eval": {"held_out": 8, "every": 0},
        }
    )


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


@pytest.mark.slow
async def test_a_job_at_two_threads_is_bit_identical_run_to_run(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the worker thread the client starts inherits it
    try:
        runs = [await run_job(_config(tmp_path / name), echo=lambda _: None) for name in "ab"]
    finally:
        torch.set_num_threads(threads)
    a, b = (r.run_dir for r in runs)
    assert _rows(a) == _rows(b)
    latest = max(int(p.name) for p in (a / "checkpoints").iterdir() if p.name.isdigit())
    wa = load_file(a / "checkpoints" / str(latest) / "model.safetensors")
    wb = load_file(b / "checkpoints" / str(latest) / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
