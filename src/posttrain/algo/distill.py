"""On-policy distillation: per-token advantages from a teacher's logprobs of the student's tokens.

The student π samples a completion; the teacher π_T scores the same tokens. With lp_t the
student's (sampler's) logprob of token x_t and q_t the teacher's, per trainable token t:

    adv_t = (q_t − lp_t) + c · A

the negative of the single-sample reverse-KL estimate log π(x_t) − log π_T(x_t) (Agarwal et
al. 2024, "On-Policy Distillation of Language Models"; Lu and Thinking Machines Lab 2025,
"On-Policy Distillation"), plus `c` times the completion's task-reward advantage A (0: pure
distillation). A policy-gradient loss on these advantages lowers the reverse KL
KL(π ‖ π_T) = E_π[log π − log π_T] on the states the student visits. The step's estimate of it,

    reverse_kl = Σ_t m_t (lp_t − q_t) / Σ_t m_t,

is reported as a metric; the sums are kept apart so that trajectories add up to the step's mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ReverseKLSums", "distill_advantages", "reverse_kl_sums"]


def _check_shapes(
    student_logp_T: torch.Tensor, teacher_logp_T: torch.Tensor, mask_T: torch.Tensor
) -> torch.Tensor:
    """The trainable positions (mask > 0); an error for mismatched shapes or an unknown
    logprob (NaN) on one of them."""
    if not student_logp_T.shape == teacher_logp_T.shape == mask_T.shape:
        raise ValueError(
            f"student logprobs {tuple(student_logp_T.shape)}, teacher logprobs "
            f"{tuple(teacher_logp_T.shape)} and mask {tuple(mask_T.shape)} must have one shape"
        )
    trainable_T = mask_T > 0
    for name, logp_T in (("student", student_logp_T), ("teacher", teacher_logp_T)):
        if bool(torch.isnan(logp_T[trainable_T]).any()):
            raise ValueError(
                f"a trainable token has no {name} logprob (NaN): distillation compares the "
                "student's and the teacher's logprob of every trainable token"
            )
    return trainable_T


def distill_advantages(
    student_logp_T: torch.Tensor,
    teacher_logp_T: torch.Tensor,
    mask_T: torch.Tensor,
    *,
    reward_adv: float = 0.0,
    reward_coef: float = 0.0,
) -> torch.Tensor:
    """adv_t = m_t · ((q_t − lp_t) + c · A), in float64; 0 where the mask is (whatever the
    logprobs hold there, NaN included)."""
    trainable_T = _check_shapes(student_logp_T, teacher_logp_T, mask_T)
    adv_T = teacher_logp_T.double() - student_logp_T.double() + reward_coef * reward_adv
    return torch.where(trainable_T, adv_T, torch.zeros_like(adv_T))


@dataclass(frozen=True)
class ReverseKLSums:
    """Σ_t (lp_t − q_t) over the trainable tokens and their count; `+` merges two sets."""

    total: float = 0.0
    count: int = 0

    def __add__(self, other: ReverseKLSums) -> ReverseKLSums:
        return ReverseKLSums(self.total + other.total, self.count + other.count)

    @property
    def mean(self) -> float:
        """The reverse-KL estimate per token (0 with no tokens)."""
        return self.total / self.count if self.count else 0.0


def reverse_kl_sums(
    student_logp_T: torch.Tensor, teacher_logp_T: torch.Tensor, mask_T: torch.Tensor
) -> ReverseKLSums:
    """Σ_t m_t (lp_t − q_t) and Σ_t [m_t > 0], in float64 (any shape, the three alike)."""
    trainable_T = _check_shapes(student_logp_T, teacher_logp_T, mask_T)
    diff = student_logp_T.double()[trainable_T] - teacher_logp_T.double()[trainable_T]
    return ReverseKLSums(float(diff.sum()), diff.numel())
