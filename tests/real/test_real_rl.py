"""A few RL steps raise the real model's reward: the shipped word-problems job
(src/posttrain/examples/word-problems.toml) on SmolLM2-135M-Instruct (`real_model_dir`),
shortened to 3 steps of 8 stories x 4 samples and judged on 16 held-out stories.

Three changes make 3 small steps enough, each measured:
- `top_p = 0.6`. At temperature 1 the model's samples are mostly wrong or too long: 1.6% of
  128 right within 24 tokens, so a step of 32 samples often has no right one and nothing to
  learn from. With top-p 0.6, 16% are right. The sampler's logprobs stay those of the whole
  distribution (top-p is not folded in), so the PPO ratio is still 1 on the update.
- Stories that add only (`operations = "+"`). With "+-", 3 steps of 32 samples learn the
  format ("Nora has 3 - 1 = 2 pencils left.") but, on some seeds, the operation of whichever
  stories happened to be rewarded ("Tom has 2 - 3 = 1 apple left." for "gets 3 more"): held-out
  accuracy after 3 steps was 3 to 14 of 16 over seeds 0-8 (4 steps on seeds 1, 5, 7, 8: 3
  to 15).
- lr 1e-3, constant: twice the shipped job's peak, for few steps (2e-3 was no better).

Measured with "+" over [run] seeds 0-8 (other training stories and samples; the held-out set is
fixed), OMP_NUM_THREADS=1: held-out greedy accuracy 0 of 16 before every time (the model
rambles past 24 tokens), 10 to 16 of 16 after (median 14); the sampled reward 0-0.125 at step 1
and 0.41-0.97 at step 3, at least 0.41 higher on every seed. The bounds: at least 8 of 16 after,
and step 3's reward at least 0.2 above step 1's. A model that learns nothing stays at 0 of 16.

Cost: 47 s with OMP_NUM_THREADS=2 at load average 1.0-1.5 (loading the model, two greedy
evaluations, three steps); 64-72 s with one thread at load 2.5 on this shared 2-core machine.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from posttrain.cli.train_cmd import example_config
from posttrain.jobs.config import parse_config
from posttrain.jobs.train_job import run_job

pytestmark = pytest.mark.slow

HELD_OUT = 16


async def test_three_rl_steps_raise_word_problem_accuracy(real_model_dir: Path, tmp_path: Path):
    raw = tomllib.loads(example_config("word-problems").read_text())
    raw["run"] |= {"output_dir": str(tmp_path), "seed": 0}
    raw["task"] |= {"operations": "+"}
    raw["model"] |= {"base_model": str(real_model_dir)}
    raw["rl"] |= {
        **{"steps": 3, "prompts_per_step": 8, "group_size": 4, "top_p": 0.6},
        **{"learning_rate": 1e-3, "lr_schedule": "constant"},
    }
    raw["eval"] |= {"held_out": HELD_OUT, "every": 0}
    result = await run_job(parse_config(raw), echo=lambda _: None)
    rows = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    rewards = [row["reward"] for row in rows if row["phase"] == "rl"]
    assert result.accuracy_before <= 1 / HELD_OUT  # measured: 0
    assert result.accuracy_after >= 8 / HELD_OUT, (result.accuracy_after, rewards)
    assert rewards[-1] >= rewards[0] + 0.2, rewards
