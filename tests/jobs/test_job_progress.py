"""A job run without a terminal prints periodic progress lines with a rate and an ETA: the SFT
warm-up used to print nothing between its first line and its last, so a slow run looked hung.
The interval is 0 here (a line per update) so the tiny job shows them."""

from __future__ import annotations

import re
import sys

from posttrain.jobs.config import parse_config
from posttrain.jobs.train_job import run_job

SFT_LINE = re.compile(
    r"^train_sft: (\d+)/4 updates \(\d+%\)  [\d.e+]+ (updates/s|s/update)  "
    r"elapsed \d+s  eta \d+s  loss [\d.]+$"
)


async def test_a_job_without_a_terminal_prints_progress_lines(tmp_path):
    assert not sys.stderr.isatty()  # pytest captures it: the job chooses lines, not a bar
    config = parse_config(
        {
            "run": {"task": "reverse", "name": "job", "output_dir": str(tmp_path), "seed": 1},
            "model": {"base_model": "tiny:qwen2:tiny", "lora_rank": 0},
            "sft": {"examples": 8, "batch_size": 4, "epochs": 2, "learning_rate": 1e-3},
            "rl": {"steps": 2, "prompts_per_step": 2, "group_size": 2, "max_tokens": 4},
            "eval": {"held_out": 4},
        }
    )
    lines: list[str] = []
    await run_job(config, echo=lines.append, progress_interval_s=0.0)
    sft = [SFT_LINE.match(line) for line in lines if line.startswith("train_sft:")]
    assert [int(m[1]) for m in sft if m] == [1, 2, 3, 4], lines  # 8 examples x 2 epochs / 4
    start = lines.index(next(x for x in lines if x.startswith("sft warm-up:")))
    assert lines[start + 1].startswith("train_sft: 1/4")  # between the warm-up's first and last
    rl = [line for line in lines if line.startswith("rl step")]
    assert len(rl) == 2 and all(re.search(r"tok/s +[\d,]+ .*  eta \d+s$", x) for x in rl)
    assert rl[-1].endswith("eta 0s")
    evals = [x for x in lines if re.match(r"held-out accuracy (before|after) RL: ", x)]
    assert len(evals) == 2
    assert all(re.search(r"greedy, \d+s, [\d.]+ problems/s\)$", x) for x in evals), evals
