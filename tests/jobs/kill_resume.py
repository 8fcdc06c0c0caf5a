"""Kill a `posttrain train` job right after RL step 2's checkpoint, then resume it.

Shared by the exact-resume tests: each compares the resumed run with an uninterrupted one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import torch


def kill_and_resume(
    config: Path,
    run_dir: Path,
    *,
    cwd: Path | None = None,
    extra_env: Mapping[str, str] | None = None,
    timeout_s: float = 120,
) -> tuple[int, subprocess.CompletedProcess[str]]:
    """Run the job in a subprocess, SIGKILL it as soon as the checkpoint of RL step 2 exists
    (model step 3: SFT is step 1), then `--resume` it to the end.

    Returns the last RL step the killed run had finished, and the resumed run's result (checked
    to have succeeded and to have said where it resumed).
    """
    # Same threads as this process, so CPU kernels sum in the same order in every run.
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), **(extra_env or {})}
    command = [sys.executable, "-m", "posttrain.cli.main", "train", str(config)]
    proc = subprocess.Popen(
        command, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    checkpoint = run_dir / "checkpoints" / "3"
    deadline = time.monotonic() + timeout_s
    while not checkpoint.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    steps_on_disk = [int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()]
    assert 3 <= max(steps_on_disk) < 6  # killed mid-run, after RL step 2's checkpoint
    resumed = subprocess.run(
        [*command, "--resume", str(run_dir)],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    done = max(steps_on_disk) - 1
    assert f"resuming after RL step {done}/5" in resumed.stdout
    return done, resumed
