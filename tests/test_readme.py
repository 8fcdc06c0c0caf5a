"""Every python example in README.md runs (on a tiny model, in a temporary directory), and the
20-line example learns: its printed reward rises."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


def test_the_demo_figures_are_a_range_over_the_runs_recorded():
    """One host's figures are not a fresh clone's (issue 35: 16.0% -> 98.0% on one run, 18.0%
    -> 99.5% on another): the README gives the range, and each run with its host."""
    text = README.read_text()
    assert "16-18% after the warm-up to 98-99.5% after RL" in text
    assert "16.0% -> 98.0%" in text and "18.0% -> 99.5%" in text and "AMD EPYC" in text


def test_the_speed_claim_names_its_hosts():
    """The vs-TRL ratios depend on the CPU (docs/benchmarks.md: 1.96x on an AMD EPYC, 1.58x on an
    Intel Xeon, the same code): the README names the host of each."""
    text = README.read_text()
    fast = text[text.index("- **Fast on a CPU**") :].split("\n- ", 1)[0]
    assert "AMD EPYC" in fast and "Xeon" in fast, fast


@pytest.mark.slow
def test_readme_examples_run(tmp_path):
    tiny = tmp_path / "tiny"
    # Blocks run in order in one process, as a reader would paste them.
    script = "\n".join(block.replace("/tmp/tiny", str(tiny)) for block in BLOCKS)
    # One thread: the run is then the same on every machine (seeded sampling, fixed init).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / ".posttrain" / "demo" / "models" / "agent-001" / "history.jsonl").exists()
    rewards = [float(r) for r in re.findall(r"^step \d+: reward ([\d.]+)$", proc.stdout, re.M)]
    assert len(rewards) == 10, proc.stdout
    # The untrained model writes about 10% lowercase letters (26 of its 260 tokens); with this
    # seed the reward goes 0.05, 0.18, 0.12, ... to 1.00 by step 9. Means of three steps smooth
    # the sampling noise: other sampling seeds gave first means 0.11-0.19 and last ones 0.85
    # or more, so these bounds hold with room (a model that learns nothing stays near 0.1).
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert first < 0.3 and last > 0.7, rewards
