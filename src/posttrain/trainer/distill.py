"""On-policy distillation in the RL step: the teacher scores every trajectory, then each
trainable token's advantage is teacher − student logprob (`algo.distill`), on the exact tokens
the student sampled and with the student's logprobs as its sampler recorded them.

Before any of it, `teacher_logprobs` refuses a teacher whose vocabulary differs from the
student's (`Teacher.check_vocabulary`). `score_groups` sends one `compute_logprobs` per trajectory (prompt and
completion together), all at once. `distill_token_advantages` then gives the per-token
advantages `prepare_batch` puts in the datums, and the step's reverse-KL estimate
(`teacher_kl`). Every group trains: a group whose rewards are all equal still has a teacher to
move towards.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

import torch

from posttrain.algo.advantages import AdvantageResult
from posttrain.algo.distill import ReverseKLSums, distill_advantages, reverse_kl_sums
from posttrain.clients.protocol import TrainingClient
from posttrain.clients.teacher import Teacher
from posttrain.data.trajectories import Trajectory, TrajectoryGroup
from posttrain.trainer.datums import trajectory_arrays
from posttrain.trainer.token_advantages import TokenAdvantages

__all__ = ["distill_token_advantages", "score_groups", "teacher_logprobs"]


def _tokens(trajectory: Trajectory) -> list[int]:
    return [t for segment in trajectory.segments for t in segment.tokens]


async def _score(teacher: Teacher, trajectory: Trajectory, where: str) -> torch.Tensor:
    """The teacher's logprob of each target (token 1..n), NaN where it gives none."""
    try:
        scored = await teacher.logprobs(_tokens(trajectory))
    except Exception as exc:
        exc.add_note(f"while teacher {teacher.name!r} scored {where}")
        raise
    return torch.tensor([math.nan if lp is None else lp for lp in scored[1:]], dtype=torch.float64)


async def score_groups(
    teacher: Teacher, groups: Sequence[TrajectoryGroup]
) -> list[list[torch.Tensor]]:
    """The teacher's target logprobs [T] of every trajectory, by group; all calls in flight."""
    calls = [
        _score(teacher, trajectory, f"group {g} trajectory {t}")
        for g, group in enumerate(groups)
        for t, trajectory in enumerate(group.trajectories)
    ]
    flat = iter(await asyncio.gather(*calls))
    return [[next(flat) for _ in group.trajectories] for group in groups]


async def teacher_logprobs(
    teacher: Teacher | None,
    student: TrainingClient,
    groups: Sequence[TrajectoryGroup],
    student_name: str,
) -> list[list[torch.Tensor]] | None:
    """With a teacher: refuse one whose vocabulary is not the student's (`VocabularyMismatch`,
    naming both), then the teacher's logprobs of every trajectory. Before any update."""
    if teacher is None:
        return None
    teacher.check_vocabulary(student.get_tokenizer(), student_name)
    return await score_groups(teacher, groups)


def distill_token_advantages(
    groups: Sequence[TrajectoryGroup],
    episode: AdvantageResult,
    teacher_logprobs: Sequence[Sequence[torch.Tensor]],
    *,
    reward_coef: float,
) -> TokenAdvantages:
    """Per trainable target: (teacher − student logprob) + reward_coef · the trajectory's task
    advantage; `teacher_kl` is the step's mean student − teacher logprob over those tokens."""
    out = TokenAdvantages(per_trajectory=[])
    kl = ReverseKLSums()
    for g, (group, adv_G, teacher_row) in enumerate(
        zip(groups, episode.advantages, teacher_logprobs, strict=True)
    ):
        row: list[torch.Tensor | None] = []
        for t, (trajectory, adv, teacher_T) in enumerate(
            zip(group.trajectories, adv_G.tolist(), teacher_row, strict=True)
        ):
            _, mask_T, student_T = trajectory_arrays(trajectory, allow_missing_logprobs=True)
            if teacher_T.shape != mask_T.shape:
                raise ValueError(
                    f"group {g} trajectory {t}: the teacher gave {teacher_T.numel()} target "
                    f"logprobs for {mask_T.numel()} targets"
                )
            try:
                adv_T = distill_advantages(
                    student_T, teacher_T, mask_T, reward_adv=adv, reward_coef=reward_coef
                )
                kl += reverse_kl_sums(student_T, teacher_T, mask_T)
            except ValueError as exc:
                raise ValueError(f"group {g} trajectory {t}: {exc}") from exc
            row.append(adv_T[mask_T > 0])
        out.per_trajectory.append(row)
    out.metrics["teacher_kl"] = kl.mean
    return out
