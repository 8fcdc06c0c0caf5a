"""How far the sampler's logprobs are from the trainer's on the same tokens.

With q the sampler's logprob and p the trainer's, per counted token δ_t = q_t − p_t:
    kl_sample_train_v1 = mean_t δ_t          (k1 estimate of KL(sampler ‖ trainer))
    kl_sample_train_v2 = mean_t ½·δ_t²       (k2 estimate, never negative)
    logprob_diff_max   = max_t |δ_t|
    logprob_diff_mean  = mean_t |δ_t|
the first three as tinker-cookbook's `compute_kl_sample_train` (tinker_cookbook/rl/metrics.py) logs them. The
sums are kept apart from the division so that mini-batches add up to the step's token mean.
Over a step's trainable tokens these include staleness when an older policy sampled them
(async RL); the parity check (`trainer.parity`) bounds mean_t |δ_t| over the tokens it
compares, reported as `parity_logprob_diff_mean`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AgreementSums:
    """Σδ, Σ½δ², max|δ|, Σ|δ| and the number of tokens compared; `+` merges two sets of
    tokens."""

    diff_sum: float = 0.0
    half_sq_sum: float = 0.0
    abs_max: float = 0.0
    count: int = 0
    abs_sum: float = 0.0

    @property
    def abs_mean(self) -> float:
        """mean_t |δ_t|; 0 when no token was compared."""
        return self.abs_sum / self.count if self.count else 0.0

    def __add__(self, other: AgreementSums) -> AgreementSums:
        return AgreementSums(
            self.diff_sum + other.diff_sum,
            self.half_sq_sum + other.half_sq_sum,
            max(self.abs_max, other.abs_max),
            self.count + other.count,
            self.abs_sum + other.abs_sum,
        )


def sample_train_agreement(
    sampler_logp_T: torch.Tensor, trainer_logp_T: torch.Tensor, mask_T: torch.Tensor
) -> AgreementSums:
    """Sums of δ_t = q_t − p_t over the tokens with mask > 0 and a known (non-NaN) q_t.

    Any shape works as long as the three agree; sums are taken in float64.
    """
    if not sampler_logp_T.shape == trainer_logp_T.shape == mask_T.shape:
        raise ValueError(
            f"sampler logprobs {tuple(sampler_logp_T.shape)}, trainer logprobs "
            f"{tuple(trainer_logp_T.shape)} and mask {tuple(mask_T.shape)} must have one shape"
        )
    counted_T = (mask_T > 0) & ~torch.isnan(sampler_logp_T)
    delta = sampler_logp_T.double()[counted_T] - trainer_logp_T.double()[counted_T]
    if delta.numel() == 0:
        return AgreementSums()
    return AgreementSums(
        diff_sum=float(delta.sum()),
        half_sq_sum=float(0.5 * delta.square().sum()),
        abs_max=float(delta.abs().max()),
        count=delta.numel(),
        abs_sum=float(delta.abs().sum()),
    )


def agreement_metrics(sums: AgreementSums) -> dict[str, float]:
    """The four metrics from accumulated sums; none when no token was compared."""
    if sums.count == 0:
        return {}
    return {
        "kl_sample_train_v1": sums.diff_sum / sums.count,
        "kl_sample_train_v2": sums.half_sq_sum / sums.count,
        "logprob_diff_max": sums.abs_max,
        "logprob_diff_mean": sums.abs_mean,
    }
