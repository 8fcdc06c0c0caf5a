"""What every RL step records about its pipeline (`jobs.pipeline.pipeline_metrics`): where its
time went, the engine sync, the staleness of its tokens and the tokens per second; in a job's
history.jsonl and metrics.jsonl rows and progress lines, and in `rl_steps`' steps."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import cast

import pytest
from test_async_rl import _Backend, _job, _Model, _run, _trajectory

from posttrain.backends.model import TrainableModel
from posttrain.backends.protocol import TrainableBackend
from posttrain.data.trajectories import TokenSegment, Trajectory, TrajectoryGroup
from posttrain.jobs.pipeline import TIMING_METRICS, Rollouts, pipeline_metrics, token_staleness
from posttrain.jobs.report import TIMING_KEYS
from posttrain.jobs.train_job import run_job
from posttrain.types import TrainResult

TIME_KEYS = ("time/sample_s", "time/wait_for_rollouts_s", "time/train_s", "time/sync_s")
KEYS = (
    *TIME_KEYS,
    "time/step_s",
    "sync/bytes",
    "sync/version",
    "staleness/max",
    "staleness/mean",
    "throughput/sampled_tokens_per_s",
    "throughput/trained_tokens_per_s",
)


def _tokens(n: int, version: int | None) -> Trajectory:
    metadata = {} if version is None else {"policy_version": version}
    return Trajectory(segments=(TokenSegment(tuple(range(n)), trainable=True),), metadata=metadata)


def test_token_staleness_weighs_each_trajectory_by_its_tokens():
    groups = [
        TrajectoryGroup([_tokens(2, 5), _tokens(4, 3)]),
        TrajectoryGroup([_tokens(3, None), _tokens(6, 6)]),  # no version: not counted
    ]
    # Model step 6: lags 1 (2 tokens), 3 (4 tokens), 0 (6 tokens): (2*1 + 4*3 + 6*0) / 12.
    assert token_staleness(groups, 6) == (3, 14 / 12)
    # A plain mean over trajectories would say (1 + 3 + 0) / 3 = 1.33: tokens weigh.
    assert token_staleness([TrajectoryGroup([_tokens(3, None)])], 6) == (0, 0.0)


def test_the_timing_metrics_are_left_out_when_runs_are_compared():
    assert TIMING_METRICS <= TIMING_KEYS
    assert {k for k in KEYS if k.startswith(("time/", "throughput/"))} == TIMING_METRICS


async def test_rl_steps_says_where_each_steps_time_went():
    backend, model = _Backend(), _Model()

    async def sample(k: int) -> list[TrajectoryGroup]:
        version = model.step  # the policy that samples, from the start
        await asyncio.sleep(0.02)
        return [TrajectoryGroup([_trajectory(version), _trajectory(version)])]

    trained = await _run(cast(TrainableBackend, backend), cast(TrainableModel, model), sample, 3, 1)
    for step in trained:
        m = step.metrics
        assert m["time/sample_s"] >= 0.02  # it slept that long
        assert 0 <= m["time/wait_for_rollouts_s"] <= m["time/step_s"]
        assert m["time/sync_s"] == 0.0 and "sync/bytes" not in m  # this backend syncs nothing
        assert m["tokens/sampled"] == m["tokens/trained"] == 4.0  # 2 trajectories x 2 tokens
    # Step 0 waits for all of its sampling (nothing ran ahead of it).
    assert trained[0].metrics["time/wait_for_rollouts_s"] >= 0.02
    # Step 1's sampling starts while step 0 waits (model step 5) and trains at 6. Step 2's task
    # is made when step 1 is taken, but this backend trains without yielding to the event loop,
    # so it starts only when step 2 awaits it, at model step 7, and trains at 7.
    assert [s.metrics["staleness/mean"] for s in trained] == [0.0, 1.0, 0.0]
    assert [s.metrics["staleness/max"] for s in trained] == [
        float(s.max_staleness) for s in trained
    ]


def _job_rows(tmp_path: Path, ahead: int) -> tuple[list[dict], list[dict], list[str]]:
    """A 3-step job on the tiny model (the live engine): its RL history.jsonl rows, its RL
    metrics.jsonl rows and its progress lines."""
    lines: list[str] = []
    config = _job(tmp_path, max_off_policy_steps=ahead)
    result = asyncio.run(run_job(config, echo=lines.append))
    history = [json.loads(x) for x in (result.run_dir / "history.jsonl").read_text().splitlines()]
    rows = [json.loads(x) for x in result.metrics_path.read_text().splitlines()]
    return (
        [r for r in history if r["split"] == "train"],
        [r for r in rows if r["phase"] == "rl"],
        [x for x in lines if x.startswith("rl step")],
    )


@pytest.mark.parametrize("ahead", [0, 1])
def test_a_jobs_rl_steps_record_their_pipeline(tmp_path: Path, ahead: int):
    history, rows, lines = _job_rows(tmp_path, ahead)
    assert [r["step"] for r in history] == [r["step"] for r in rows] == [1, 2, 3]
    for logged, row in zip(history, rows, strict=True):
        assert all(key in logged for key in KEYS)
        assert {k: row[k] for k in KEYS} == {k: logged[k] for k in KEYS}  # the same values
        assert all(logged[key] >= 0 for key in TIME_KEYS)
        # The step's wall time holds the wait, the training and the sync, timed inside it, one
        # after another (1e-9: the rounding of the subtractions that make them).
        parts = logged["time/wait_for_rollouts_s"] + logged["time/train_s"] + logged["time/sync_s"]
        assert parts <= logged["time/step_s"] + 1e-9
        assert logged["time/step_s"] <= row["step_s"]  # which adds the logging
        assert logged["sync/version"] == logged["step"]  # the engine serves the step's weights
        assert logged["sync/bytes"] == 0.0  # the live engine samples the trainer's own weights
        # Throughput is tokens over seconds; every trajectory trains (none is stale).
        assert logged["tokens/trained"] == logged["tokens/sampled"] == row["sampled_tokens"]
        assert logged["throughput/sampled_tokens_per_s"] == pytest.approx(
            logged["tokens/sampled"] / logged["time/sample_s"], rel=1e-12
        )
        assert logged["throughput/trained_tokens_per_s"] == pytest.approx(
            logged["tokens/trained"] / logged["time/train_s"], rel=1e-12
        )
        if not ahead:  # the trainer waits for the whole sampling: it starts when asked
            assert logged["time/sample_s"] <= logged["time/wait_for_rollouts_s"]
    # Synchronous: each step samples its own policy. One step ahead: steps 2 and 3 train on
    # the tokens of the policy one step back (step 1's on the first policy's: none came before).
    expected = [0.0, 0.0, 0.0] if not ahead else [0.0, 1.0, 1.0]
    assert [r["staleness/mean"] for r in history] == expected
    assert [r["staleness/max"] for r in history] == expected
    assert all(" wait " in x and " sync " in x and f" stale {e:.2f} " in x
               for x, e in zip(lines, expected, strict=True))  # fmt: skip


def test_tokens_trained_are_what_the_trainer_trained():
    """A step whose groups all have equal rewards trains nothing: 0 trained tokens (and no
    trained tokens per second), not the 6 tokens it was handed; a backend that reports no count
    gets the tokens it was handed."""
    groups = [TrajectoryGroup([_tokens(2, 0), _tokens(4, 0)])]
    rollouts = Rollouts(groups, sample_s=1.0, wait_s=0.0)
    none = TrainResult(step=1, metrics={"nothing_to_train": 1.0, "num_trainable_tokens": 0.0})
    m = pipeline_metrics(groups, groups, 1, none, rollouts, train_call_s=0.5, step_s=1.5)
    assert (m["tokens/sampled"], m["tokens/trained"]) == (6.0, 0.0)
    assert m["throughput/trained_tokens_per_s"] == 0.0
    silent = TrainResult(step=1, metrics={"loss": 0.1})  # a plugin backend's bare metrics
    m = pipeline_metrics(groups, groups, 1, silent, rollouts, train_call_s=0.5, step_s=1.5)
    assert m["tokens/trained"] == 6.0 and m["throughput/trained_tokens_per_s"] == 12.0
