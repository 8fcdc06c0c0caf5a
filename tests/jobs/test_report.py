"""What a resume keeps of the job's logs, the progress line, and the job's state."""

from __future__ import annotations

import json

import pytest

from posttrain.jobs.report import MetricsLog, progress_line, rewind_history
from posttrain.jobs.run_dir import JobState


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_metrics_rewind_keeps_what_the_checkpoint_covers(tmp_path):
    # Order the job writes them in: sft row, [checkpoint 1], eval 0, rl 1, [ckpt 2], rl 2,
    # [ckpt 3], eval 2, rl 3 (killed before its checkpoint).
    rows = [
        {"phase": "sft", "step": 1},
        {"phase": "eval", "step": 0},
        {"phase": "rl", "step": 1},
        {"phase": "rl", "step": 2},
        {"phase": "eval", "step": 2},
        {"phase": "rl", "step": 3},
    ]
    log = MetricsLog(tmp_path / "metrics.jsonl")
    _write(log.path, rows)
    log.rewind(2, sft_done=True)  # resumed from the checkpoint after RL step 2
    # eval 2 ran after that checkpoint and rl 3 was never checkpointed: both are redone.
    assert log.rows() == rows[:4]
    log.rewind(0, sft_done=False)  # killed before the SFT checkpoint: everything is redone
    assert log.rows() == []


def test_history_rewind_keeps_train_rows_up_to_the_step_and_earlier_evaluations(tmp_path):
    rows = [
        {"step": 1, "split": "train"},
        {"step": 1, "split": "val"},  # evaluated after checkpoint 1
        {"step": 2, "split": "train"},
        {"step": 2, "split": "val"},
        {"step": 3, "split": "train"},
    ]
    path = tmp_path / "history.jsonl"
    _write(path, rows)
    rewind_history(path, 2)
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:3]
    rewind_history(tmp_path / "absent.jsonl", 0)  # nothing to rewind, nothing created
    assert not (tmp_path / "absent.jsonl").exists()


def test_progress_line_says_what_tok_s_is():
    row = {"reward": 0.5, "accuracy": 0.25, "loss": float("nan"), "tokens_per_s": 1234.4,
           "elapsed_s": 3.0}  # fmt: skip
    assert progress_line(2, 10, row) == (
        "rl step    2/10  reward 0.500  acc 0.250  loss     n/a  tok/s   1,234  elapsed    3.0s"
    )
    assert progress_line(2, 10, row, eta_s=125.2).endswith("elapsed    3.0s  eta 2m05s")


def test_progress_line_shows_the_wait_the_sync_and_the_staleness_where_the_row_has_them():
    row = {"reward": 0.5, "accuracy": 0.25, "loss": 0.125, "tokens_per_s": 99.6,
           "elapsed_s": 3.0, "time/wait_for_rollouts_s": 0.004, "time/sync_s": 1.236,
           "staleness/mean": 2 / 3}  # fmt: skip
    assert progress_line(2, 10, row) == (
        "rl step    2/10  reward 0.500  acc 0.250  loss +0.1250  tok/s     100  wait 0.00s  "
        "sync 1.24s  stale 0.67  elapsed    3.0s"
    )


def test_job_state_round_trips_and_refuses_unknown_keys():
    state = JobState.load({})
    assert state == JobState(sft_done=False, accuracy_before=None, rl_steps_done=0)
    state.rl_steps_done, state.accuracy_before = 3, 0.5
    run_state = {}
    state.save(run_state)
    assert run_state == {
        "sft_done": False,
        "dpo_done": False,
        "accuracy_before": 0.5,
        "rl_steps_done": 3,
    }
    assert JobState.load(run_state) == state
    with pytest.raises(ValueError, match=r"keys this job does not know: \['cursor'\]"):
        JobState.load({"cursor": 1})
