"""trainer.distill: the teacher scores each trajectory's exact tokens in one call, and the
datums carry teacher − student logprob on each trainable target (hand values), every group kept,
the task advantage mixed in by `distill_reward_coef`, and `teacher_kl` in the step's flow.

Tolerances: the datums' advantages are float32, so hand values match to 1e-6.
"""

from __future__ import annotations

import pytest

from posttrain.clients.teacher import Teacher, vocabulary_difference
from posttrain.data.trajectories import TokenSegment, Trajectory, TrajectoryGroup
from posttrain.models.tiny import build_tokenizer
from posttrain.trainer.config import RLConfig, from_options
from posttrain.trainer.distill import score_groups
from posttrain.trainer.rl import prepare_batch
from posttrain.types import ModelInput

# Teacher logprob of token id k at any position: -k/100 (None for the first token).


class TableTeacher:
    """A stand-in teacher client: log p(token k) = -k/100, and a record of what it scored."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    async def compute_logprobs(self, prompt: ModelInput) -> list[float | None]:
        tokens = prompt.to_ints()
        self.calls.append(tokens)
        return [None, *(-t / 100 for t in tokens[1:])]

    def get_tokenizer(self) -> object:
        return build_tokenizer()


def trajectory(reward: float, sampled: tuple[int, ...], logprobs: tuple[float, ...]) -> Trajectory:
    return Trajectory((TokenSegment((1, 2)), TokenSegment(sampled, True, logprobs)), reward)


def groups() -> list[TrajectoryGroup]:
    return [
        TrajectoryGroup(
            (
                trajectory(1.0, (10, 20), (-0.5, -0.1)),
                trajectory(0.0, (30,), (-0.2,)),
            )
        ),
        # Equal rewards: a GRPO step would drop this group; a distillation step trains it.
        TrajectoryGroup((trajectory(0.5, (40, 50), (-1.0, -0.3)),) * 2),
    ]


async def test_datums_carry_teacher_minus_student_on_the_exact_tokens():
    client = TableTeacher()
    teacher = Teacher(client, name="table")
    scored = await score_groups(teacher, groups())
    # One call per trajectory, on its exact tokens: prompt then completion.
    assert client.calls == [[1, 2, 10, 20], [1, 2, 30], [1, 2, 40, 50], [1, 2, 40, 50]]
    config = from_options(RLConfig, {"teacher": teacher})
    batch = prepare_batch(groups(), config, teacher_logprobs=scored)
    assert len(batch.datums) == 4 and batch.num_dropped_groups == 0
    advantages = [d.loss_fn_inputs["advantages"].tolist() for d in batch.datums]
    # Targets are tokens 2.. (the prompt's second token is context, advantage 0):
    # q − lp: token 10: -0.10+0.5 = 0.40; 20: -0.20+0.1 = -0.10; 30: -0.30+0.2 = -0.10;
    #         40: -0.40+1.0 = 0.60; 50: -0.50+0.3 = -0.20.
    expected = [[0.0, 0.40, -0.10], [0.0, -0.10], [0.0, 0.60, -0.20], [0.0, 0.60, -0.20]]
    for got, want in zip(advantages, expected, strict=True):
        assert got == pytest.approx(want, abs=1e-6)
    # teacher_kl = mean(lp − q) = -(0.40 - 0.10 - 0.10 + 2 * (0.60 - 0.20)) / 7 = -1.0 / 7
    # (the student's logprobs pass through float32: 1e-7).
    assert batch.metrics["teacher_kl"] == pytest.approx(-1.0 / 7, abs=1e-7)


async def test_the_task_advantage_is_mixed_in_by_its_coefficient():
    teacher = Teacher(TableTeacher(), name="table")
    scored = await score_groups(teacher, groups())
    config = from_options(RLConfig, {"teacher": teacher, "distill_reward_coef": 0.5})
    batch = prepare_batch(groups(), config, teacher_logprobs=scored)
    # Group 0's GRPO advantages (rewards 1, 0; std-scaled) are +1 and -1 (up to eps);
    # group 1's are 0. Each trainable token gets 0.5 x its trajectory's.
    first = batch.datums[0].loss_fn_inputs["advantages"].tolist()
    second = batch.datums[1].loss_fn_inputs["advantages"].tolist()
    assert first == pytest.approx([0.0, 0.40 + 0.5, -0.10 + 0.5], abs=1e-4)
    assert second == pytest.approx([0.0, -0.10 - 0.5], abs=1e-4)


async def test_a_teacher_that_gives_no_logprob_for_a_sampled_token_is_an_error():
    class Gappy(TableTeacher):
        async def compute_logprobs(self, prompt: ModelInput) -> list[float | None]:
            return [None] * len(prompt.to_ints())

    teacher = Teacher(Gappy(), name="gappy")
    scored = await score_groups(teacher, groups())
    with pytest.raises(ValueError, match=r"group 0 trajectory 0: .*no teacher logprob"):
        prepare_batch(
            groups(), from_options(RLConfig, {"teacher": teacher}), teacher_logprobs=scored
        )

    class Short(TableTeacher):
        async def compute_logprobs(self, prompt: ModelInput) -> list[float | None]:
            return [None]

    with pytest.raises(ValueError, match="returned 1 logprobs for 4 tokens") as caught:
        await score_groups(Teacher(Short(), name="short"), groups())
    assert "group 0 trajectory 0" in "\n".join(caught.value.__notes__)


def test_vocabularies_are_compared_whole():
    same, other = build_tokenizer(), build_tokenizer()
    assert vocabulary_difference(same, other) is None
    other.add_tokens(["<|tool|>"])
    assert vocabulary_difference(same, other) == (
        "the teacher's vocabulary has 260 tokens, the student's 261"
    )
    teacher = Teacher(TableTeacher(), name="big-teacher")
    with pytest.raises(ValueError, match="teacher 'big-teacher' and student 'small'") as caught:
        teacher.check_vocabulary(other, "'small'")
    assert "same tokenizer" in str(caught.value)


def test_a_client_without_compute_logprobs_is_refused():
    with pytest.raises(TypeError, match="compute_logprobs"):
        Teacher(object(), name="x")  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match="compute_logprobs_async"):
        Teacher.from_tinker(object())
