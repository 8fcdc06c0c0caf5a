"""Asynchronous RL (`jobs.pipeline.rl_steps`): with no staleness allowed it is the plain loop;
with some, rollouts are sampled ahead, labelled with the policy that sampled them, and the
stale ones are dropped and counted."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest
import torch

from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.backends.protocol import TrainableBackend
from posttrain.data.trajectories import Trajectory, TrajectoryGroup
from posttrain.inference.model_sampler import ModelSampler
from posttrain.jobs.config import JobConfig, parse_config
from posttrain.jobs.pipeline import TrainedStep, drop_stale, rl_steps
from posttrain.jobs.train_job import run_job
from posttrain.rollouts.builder import TrajectoryBuilder
from posttrain.tasks import Problem, ReverseTask
from posttrain.types import SamplingParams, StopReason, TrainResult

SPLIT: dict[str, object] = {"devices": "cpu,cpu", "threads": 1}  # the sampler in its own process
Sample = Callable[[int], Awaitable[Sequence[TrajectoryGroup]]]


def _sampler_groups(sampler: ModelSampler, seen: dict[int, list[int]]) -> Sample:
    """Step k: 2 prompts x 4 completions seeded by k, rewarded by their index (so every group
    has reward variance and trains); `seen[k]` gets the policy versions that sampled them."""

    async def sample(k: int) -> list[TrajectoryGroup]:
        builders = []
        for text in ("abc", "xyz"):
            builder = TrajectoryBuilder(sampler.tokenizer)
            builder.prompt({"role": "user", "content": text})
            builders.append(builder)
        params = SamplingParams(max_tokens=6, seed=100 + k, stop=[])
        responses = await sampler.sample_many([b.tokens for b in builders], 4, params)
        groups = []
        for builder, response in zip(builders, responses, strict=True):
            assert response.policy_version is not None
            seen.setdefault(k, []).append(response.policy_version)
            trajectories = []
            for i, sequence in enumerate(response.sequences):
                turn = builder.fork()
                turn.completion(sequence)
                metadata = {"policy_version": response.policy_version}
                trajectories.append(turn.build(reward=float(i), metadata=metadata))
            groups.append(TrajectoryGroup(trajectories))
        return groups

    return sample


async def _registered(
    path: Path, base: Path, **backend: object
) -> tuple[LocalBackend, TrainableModel]:
    local = LocalBackend(path, **backend)  # pyright: ignore[reportArgumentType]
    model = TrainableModel(name="m", project="p", base_model=str(base), lora_rank=4, seed=0)
    await model.register(local)
    return local, model


async def _run(
    backend: TrainableBackend, model: TrainableModel, sample: Sample, steps: int, ahead: int
) -> list[TrainedStep]:
    trained = rl_steps(
        backend,
        model,
        sample,
        steps=steps,
        max_off_policy_steps=ahead,
        options=lambda k: {"learning_rate": 5e-2, "save_checkpoint": False},
    )
    async with aclosing(trained) as run:
        return [step async for step in run]


async def _weights(backend: LocalBackend, model: TrainableModel) -> dict[str, torch.Tensor]:
    return await backend.client(model).trainable_weights()


async def test_rl_steps_without_staleness_is_the_plain_loop(tiny_model_dir: Path, tmp_path: Path):
    plain, model = await _registered(tmp_path / "plain", tiny_model_dir)
    try:
        initial = await _weights(plain, model)
        sample = _sampler_groups(plain.sampling_client(model), {})
        expected = []
        for k in range(3):
            groups = await sample(k)
            result = await plain.train(model, groups, learning_rate=5e-2, save_checkpoint=False)
            expected.append(result.metrics)
        plain_weights = await _weights(plain, model)
    finally:
        await plain.close()
    piped, model = await _registered(tmp_path / "piped", tiny_model_dir)
    try:
        seen: dict[int, list[int]] = {}
        steps = await _run(piped, model, _sampler_groups(piped.sampling_client(model), seen), 3, 0)
        piped_weights = await _weights(piped, model)
    finally:
        await piped.close()
    # Same process, same seeds, same calls in the same order: bit for bit the same.
    assert [s.result.metrics for s in steps] == expected
    assert [s.step for s in steps] == [0, 1, 2] and [s.result.step for s in steps] == [1, 2, 3]
    assert all(s.stale_trajectories == 0 and s.max_staleness == 0 for s in steps)
    assert seen == {0: [0, 0], 1: [1, 1], 2: [2, 2]}  # each step sampled its own policy
    assert plain_weights.keys() == piped_weights.keys()
    assert all(torch.equal(plain_weights[n], piped_weights[n]) for n in plain_weights)
    # The steps trained: the comparison covers updates, not just the base weights.
    assert any(not torch.equal(initial[n], plain_weights[n]) for n in initial)


async def test_rl_steps_samples_one_step_ahead(tiny_model_dir: Path, tmp_path: Path):
    backend, model = await _registered(tmp_path, tiny_model_dir)
    try:
        seen: dict[int, list[int]] = {}
        steps = await _run(
            backend, model, _sampler_groups(backend.sampling_client(model), seen), 4, 1
        )
    finally:
        await backend.close()
    # Step k trains on rollouts of the policy before it (step 0's own: nothing came before);
    # step 1's were sampled with step 0's, while step 0 trained.
    assert seen == {0: [0, 0], 1: [0, 0], 2: [1, 1], 3: [2, 2]}
    assert [s.max_staleness for s in steps] == [0, 1, 1, 1]
    assert all(s.stale_trajectories == 0 for s in steps)
    versions = [{t.metadata["policy_version"] for g in s.groups for t in g} for s in steps]
    assert versions == [{0}, {0}, {1}, {2}]


async def test_split_engine_samples_while_the_trainer_trains(tiny_model_dir: Path, tmp_path: Path):
    """With the sampler in a process of its own, step k+1's sampling request is being answered
    by that process while step k's forward_backward computes on the trainer's thread."""
    backend, model = await _registered(tmp_path, tiny_model_dir, inference=SPLIT)
    computing: list[tuple[float, float]] = []  # forward_backward, on the trainer's thread
    sampling: list[tuple[int, float, float]] = []  # (step, start, end) of each sampling request
    try:
        dispatch = backend.client(model).dispatch
        forward_backward = dispatch.forward_backward

        def timed_forward_backward(*args: object, **kwargs: object) -> object:
            assert threading.current_thread() is not threading.main_thread()
            began = time.perf_counter()
            try:
                return forward_backward(*args, **kwargs)  # pyright: ignore[reportArgumentType]
            finally:
                computing.append((began, time.perf_counter()))

        dispatch.forward_backward = timed_forward_backward  # pyright: ignore[reportAttributeAccessIssue]
        trainer_sampled: list[object] = []  # the trainer's own sampler: never used when split
        dispatch.sample = lambda *args, **kwargs: trainer_sampled.append(args)  # pyright: ignore[reportAttributeAccessIssue]
        seen: dict[int, list[int]] = {}
        inner = _sampler_groups(backend.sampling_client(model), seen)

        async def sample(k: int) -> Sequence[TrajectoryGroup]:
            began = time.perf_counter()
            groups = await inner(k)
            sampling.append((k, began, time.perf_counter()))
            return groups

        steps = await _run(backend, model, sample, 3, 1)
    finally:
        await backend.close()
    assert seen == {0: [0, 0], 1: [0, 0], 2: [1, 1]}
    assert [s.max_staleness for s in steps] == [0, 1, 1]
    assert trainer_sampled == []  # so the engine process answered while the trainer computed
    ahead = [(a, b) for k, a, b in sampling if k > 0]
    assert any(a < d and c < b for a, b in ahead for c, d in computing), (sampling, computing)


class _Model:
    step = 5


class _Backend:
    """Records what it is asked to train; never trains."""

    def __init__(self) -> None:
        self.trained: list[list[TrajectoryGroup]] = []

    async def train(self, model: _Model, groups: list[TrajectoryGroup], **options: object):
        self.trained.append(groups)
        model.step += 1
        return TrainResult(step=model.step, metrics={})


def _trajectory(version: int | None) -> Trajectory:
    from posttrain.data.trajectories import TokenSegment

    metadata = {} if version is None else {"policy_version": version}
    return Trajectory(segments=(TokenSegment((1, 2), trainable=True),), metadata=metadata)


def test_drop_stale_counts_what_it_drops():
    # Model step 5, at most 1 step off-policy: versions 4 and 5 are kept, 3 is stale.
    mixed = TrajectoryGroup([_trajectory(5), _trajectory(3), _trajectory(4), _trajectory(None)])
    fresh = TrajectoryGroup([_trajectory(5), _trajectory(5)])
    old = TrajectoryGroup([_trajectory(2), _trajectory(3)])
    result = drop_stale([mixed, fresh, old], 5, 1)
    assert result.stale_trajectories == 3  # one of `mixed`, both of `old`
    assert result.max_staleness == 1  # 5 - 4
    assert len(result.groups) == 2 and result.groups[1] is fresh  # untouched: the same object
    assert [t.metadata.get("policy_version") for t in result.groups[0]] == [5, 4, None]
    with pytest.raises(ValueError, match=r"every trajectory is stale.*2 dropped"):
        drop_stale([old], 5, 1)


async def test_a_stale_trajectory_from_the_sample_function_is_dropped_and_counted():
    backend, model = _Backend(), _Model()

    async def sample(k: int) -> list[TrajectoryGroup]:
        # Each step returns one trajectory of the current policy and one of 3 steps before.
        return [TrajectoryGroup([_trajectory(model.step), _trajectory(model.step - 3)])]

    steps = rl_steps(
        cast(TrainableBackend, backend),
        cast(TrainableModel, model),
        sample,
        steps=2,
        max_off_policy_steps=1,
    )
    async with aclosing(steps) as run:
        trained = [s async for s in run]
    assert [s.stale_trajectories for s in trained] == [1, 1]
    assert [len(g[0]) for g in backend.trained] == [1, 1]
    # Step 1's rollouts were sampled at model step 5, before step 0 trained: 1 step stale.
    assert [s.max_staleness for s in trained] == [0, 1]


async def test_leaving_the_loop_cancels_the_rollouts_sampled_ahead():
    backend, model = _Backend(), _Model()
    cancelled: list[int] = []
    release = asyncio.Event()

    async def sample(k: int) -> list[TrajectoryGroup]:
        if k > 0:
            try:
                await release.wait()  # never set: only cancellation ends it
            except asyncio.CancelledError:
                cancelled.append(k)
                raise
        return [TrajectoryGroup([_trajectory(model.step), _trajectory(model.step)])]

    steps = rl_steps(
        cast(TrainableBackend, backend),
        cast(TrainableModel, model),
        sample,
        steps=10,
        max_off_policy_steps=2,
    )
    async with aclosing(steps) as run:
        async for trained in run:
            assert trained.step == 0
            break
    assert cancelled == [1, 2]  # the two steps sampled ahead, cancelled on leaving
    negative = rl_steps(
        cast(TrainableBackend, backend),
        cast(TrainableModel, model),
        sample,
        steps=1,
        max_off_policy_steps=-1,
    )
    with pytest.raises(ValueError, match="max_off_policy_steps must be >= 0"):
        await anext(negative)


@dataclass(frozen=True)
class ScatteredTask(ReverseTask):
    """Reverse's problems with a reward that differs between completions, so that every step
    trains (the tiny model never reverses a word, and equal rewards train nothing)."""

    def reward(self, problem: Problem, completion: str, stop_reason: StopReason) -> float:
        return sum(map(ord, completion)) % 5 / 4


def scattered_task() -> ScatteredTask:
    return ScatteredTask()


def _job(output: Path, inference: dict[str, object] | None = None, **rl: object) -> JobConfig:
    return parse_config(
        {
            "inference": inference or {},
            "run": {
                "task": "test_async_rl:scattered_task",
                "name": "job",
                "output_dir": str(output),
                "seed": 3,
            },
            "model": {"base_model": "tiny:qwen2:tiny", "lora_rank": 0},
            "rl": {
                "steps": 3,
                "prompts_per_step": 2,
                "group_size": 4,
                "max_tokens": 6,
                "learning_rate": 1e-3,
                **rl,
            },
            "eval": {"held_out": 2, "every": 2},
        }
    )


def _rows(run_dir: Path, phase: str) -> list[dict[str, object]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["phase"] == phase]


@pytest.mark.parametrize("inference", [{}, SPLIT], ids=["live", "split"])
async def test_a_job_with_max_off_policy_steps_samples_ahead_and_reports_staleness(
    tmp_path: Path, inference: dict[str, object]
):
    config = _job(tmp_path, inference, max_off_policy_steps=1)
    result = await run_job(config, echo=lambda line: None)
    rl = _rows(result.run_dir, "rl")
    assert [r["step"] for r in rl] == [1, 2, 3]
    assert all(isinstance(r["loss"], float) for r in rl)  # every step trained
    # Step 1 trains on the first policy's rollouts; steps 2 and 3 on the policy one step back.
    assert [r["max_staleness"] for r in rl] == [0.0, 1.0, 1.0]
    assert [r["stale_trajectories"] for r in rl] == [0.0, 0.0, 0.0]
    assert [r["policy_version"] for r in rl] == [1.0, 2.0, 3.0]  # the engine after each step
    assert [r["step"] for r in _rows(result.run_dir, "eval")] == [0, 2, 3]  # [eval] every = 2


class Killed(Exception):
    """Stands in for the process dying between two RL steps."""


def _kill_after(step: int) -> Callable[[int], None]:
    def on_step(done: int) -> None:
        if done == step:
            raise Killed

    return on_step


async def test_a_killed_asynchronous_job_resumes_from_its_data_cursor(tmp_path: Path):
    config = _job(tmp_path, max_off_policy_steps=1)
    with pytest.raises(Killed):  # step 2's rollouts were being sampled: they are lost
        await run_job(config, on_step=_kill_after(1), echo=lambda line: None)
    run_dir = tmp_path / "posttrain" / "models" / "job"
    lines: list[str] = []
    await run_job(config, resume=run_dir, echo=lines.append)
    assert any("resuming after RL step 1/3" in line for line in lines)
    rl = _rows(run_dir, "rl")
    assert [r["step"] for r in rl] == [1, 2, 3]  # each step once: the cursor is exact
    # The resumed run samples step 2 afresh from the restored weights: not stale, unlike the
    # uninterrupted run's step 2 (sampled while step 1 trained).
    assert [r["max_staleness"] for r in rl] == [0.0, 0.0, 1.0]
    assert [r["policy_version"] for r in rl] == [1.0, 2.0, 3.0]
