"""trainer.steps: a step function checks its input and prepares before it hands its updates to
the caller's runner, so bad input fails with nothing run, nothing opened and nothing to undo;
and the runner owns the updates (a backend runs them inside its all-or-nothing step)."""

from __future__ import annotations

from typing import cast

import pytest

from posttrain.clients.protocol import ReferenceScorer, TrainingClient
from posttrain.clients.teacher import Teacher, VocabularyMismatch
from posttrain.data.preferences import PreferencePair
from posttrain.data.trajectories import TokenSegment, Trajectory, TrajectoryGroup
from posttrain.models.tiny import build_tokenizer
from posttrain.trainer.config import DPOConfig, RLConfig, SFTConfig, from_options
from posttrain.trainer.dpo import train_dpo
from posttrain.trainer.metrics import StepMetrics
from posttrain.trainer.rl import train_rl_step
from posttrain.trainer.sft import train_sft
from posttrain.trainer.steps import Updates
from posttrain.types import ModelInput


class NoUpdates:
    """A student client that only has a tokenizer: any pass or update fails the test."""

    def __init__(self, extra_tokens: tuple[str, ...] = ()) -> None:
        self.tokenizer = build_tokenizer()
        self.tokenizer.add_tokens(list(extra_tokens))

    def get_tokenizer(self) -> object:
        return self.tokenizer

    def set_logprob_chunk_size(self, chunk_size: int) -> None:
        """A setting for the passes to come, not a pass."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"the step called {name} on the client")


def student(extra_tokens: tuple[str, ...] = ()) -> TrainingClient:
    return cast(TrainingClient, NoUpdates(extra_tokens))  # only what a step reads before updates


class Scorer:
    async def compute_logprobs(self, prompt: ModelInput) -> list[float | None]:
        return [None] + [-1.0] * (len(prompt.to_ints()) - 1)

    def get_tokenizer(self) -> object:
        return build_tokenizer()


class Recorder:
    """A runner and openers that record being called; the runner runs nothing."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.metrics = StepMetrics(num_trajectories=7)

    async def run(self, updates: Updates) -> StepMetrics:
        self.calls.append("run")
        return self.metrics

    async def open_critic(self) -> TrainingClient:
        self.calls.append("critic")
        return student()

    async def open_reference(self) -> ReferenceScorer | None:
        self.calls.append("reference")
        return None  # the client's own


def groups() -> list[TrajectoryGroup]:
    def trajectory(reward: float) -> Trajectory:
        return Trajectory((TokenSegment((1, 2)), TokenSegment((3, 4), True, (-0.5, -0.5))), reward)

    return [TrajectoryGroup((trajectory(1.0), trajectory(0.0)))]


async def test_a_teacher_of_another_vocabulary_fails_before_anything_runs_or_opens():
    seen = Recorder()
    config = from_options(
        RLConfig, {"teacher": Teacher(Scorer(), name="t"), "kl_penalty_coef": 0.1}
    )
    with pytest.raises(VocabularyMismatch, match="teacher 't' and student 'student'"):
        await train_rl_step(
            student(("<|tool|>",)),
            groups(),
            config,
            reference=seen.open_reference,
            student="'student'",
            run=seen.run,
        )
    assert seen.calls == []


async def test_bad_groups_fail_before_anything_runs_or_opens():
    seen = Recorder()
    config = from_options(RLConfig, {"advantage_estimator": "gae"})
    with pytest.raises(ValueError, match="empty list of trajectory groups"):
        await train_rl_step(student(), [], config, critic=seen.open_critic, run=seen.run)
    assert seen.calls == []


async def test_the_runner_owns_the_updates_and_openers_run_only_when_needed():
    seen = Recorder()
    client = student()
    got = await train_rl_step(
        client,
        groups(),
        RLConfig(),  # grpo without a KL penalty: no critic, no reference
        critic=seen.open_critic,
        reference=seen.open_reference,
        run=seen.run,
    )
    assert got is seen.metrics and seen.calls == ["run"]
    sft = await train_sft(client, groups()[0].trajectories, SFTConfig(), run=seen.run)
    assert sft is seen.metrics and seen.calls == ["run", "run"]
    pair = PreferencePair((5, 6), (7,), (8,))
    dpo = await train_dpo(client, [pair], DPOConfig(), reference=seen.open_reference, run=seen.run)
    assert dpo is seen.metrics
    # The base reference (DPO's default) is opened once the pairs passed their checks.
    assert seen.calls == ["run", "run", "reference", "run"]
