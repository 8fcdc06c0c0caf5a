"""Importance ratios and their corrections, shared by the policy losses in `algo.losses`.

Token and sequence level ratios (GSPO), truncated importance sampling, KL estimators, ART's
centred KL advantage shaping, and unknown (NaN) logprobs. Every function works on padded
[B, T] tensors and a boolean mask of the tokens that count; nothing here reduces across rows,
so results never depend on how a batch is split into micro-batches.
"""

from __future__ import annotations

from typing import Literal

import torch

ImportanceSamplingLevel = Literal["token", "sequence", "average", "geometric_average"]
KLEstimator = Literal["k1", "k3"]

IMPORTANCE_SAMPLING_LEVELS: tuple[ImportanceSamplingLevel, ...] = (
    "token",
    "sequence",
    "average",
    "geometric_average",
)
KL_ESTIMATORS: tuple[KLEstimator, ...] = ("k1", "k3")

# Log-ratios are clamped before exp, as ART and SkyRL do: e^20 ~ 5e8 stays finite in fp16/bf16
# products, and a token that far off-policy is clipped or dropped by every loss anyway.
LOG_RATIO_BOUND = 20.0


def masked_row_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean of each row over its mask tokens; 0 for a row without any."""
    total_B = torch.where(mask_BT, x_BT, 0.0).sum(dim=-1)
    return total_B / mask_BT.sum(dim=-1).clamp(min=1)


def log_ratio(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor) -> torch.Tensor:
    """Δ_t = log π_θ(y_t) − log π_old(y_t), clamped to ±LOG_RATIO_BOUND."""
    return (logp_BT - old_logp_BT).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def sequence_log_ratio(
    logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, mask_BT: torch.Tensor
) -> torch.Tensor:
    """GSPO-token log-ratio (Zheng et al. 2025): log s_t = sg(log s_b) + lp_t − sg(lp_t).

    log s_b = mean_{t∈M_b} Δ_t. The value is the sequence ratio on every token; the gradient is
    s_b·∇lp_t, token by token.
    """
    log_s_B = masked_row_mean(log_ratio(logp_BT.detach(), old_logp_BT), mask_BT)
    return log_s_B[:, None] + (logp_BT - logp_BT.detach())


def importance_ratio(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    level: ImportanceSamplingLevel,
) -> torch.Tensor:
    """π_θ/π_old per token ("token"), per sequence ("sequence", GSPO-token), or their
    arithmetic ("average") or geometric ("geometric_average") mean, as ART's option of that name.
    """
    match level:
        case "token":
            return log_ratio(logp_BT, old_logp_BT).exp()
        case "sequence":
            return sequence_log_ratio(logp_BT, old_logp_BT, mask_BT).exp()
        case "average":
            token_BT = log_ratio(logp_BT, old_logp_BT).exp()
            return (token_BT + sequence_log_ratio(logp_BT, old_logp_BT, mask_BT).exp()) / 2
        case "geometric_average":
            log_token_BT = log_ratio(logp_BT, old_logp_BT)
            return ((log_token_BT + sequence_log_ratio(logp_BT, old_logp_BT, mask_BT)) / 2).exp()


def truncated_is_weight(
    old_logp_BT: torch.Tensor, sampler_logp_BT: torch.Tensor, cap: float
) -> torch.Tensor:
    """TIS weight sg(min(π_old/π_sampler, U)) for the sampler/trainer mismatch.

    Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training".
    """
    return log_ratio(old_logp_BT, sampler_logp_BT).exp().clamp(max=cap).detach()


def kl_estimate(
    logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, estimator: KLEstimator
) -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) on samples of π_θ (Schulman, "Approximating KL
    Divergence", 2020): k1 = lp − ref; k3 = e^{ref−lp} − (ref − lp) − 1 (unbiased, >= 0).
    """
    match estimator:
        case "k1":
            return logp_BT - ref_logp_BT
        case "k3":
            log_r_BT = (ref_logp_BT - logp_BT).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
            return log_r_BT.exp() - log_r_BT - 1


def kl_shaped_advantages(
    adv_BT: torch.Tensor, kl_BT: torch.Tensor, mask_BT: torch.Tensor, coef: float
) -> torch.Tensor:
    """ART's centred KL shaping, centred per row: A_t + β·(k̄_b − k_t)·m_t, no gradient through k.

    ART centres on the mean over its whole packed batch, which changes with the micro-batch
    split; the row mean k̄_b does not. A caller that wants ART's batch-wide centring shapes the
    advantages itself over the mini-batch and leaves `kl_penalty_coef` at 0.
    """
    kl_BT = torch.where(mask_BT, kl_BT.detach(), 0.0)
    kl_mean_B = masked_row_mean(kl_BT, mask_BT)
    return adv_BT + coef * torch.where(mask_BT, kl_mean_B[:, None] - kl_BT, 0.0)


def known_logprobs(
    values_BT: torch.Tensor,
    fallback_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    key: str,
    remedy: str | None,
) -> torch.Tensor:
    """`values_BT` with its non-finite entries (logprob unknown) replaced by `fallback_BT`.

    Off the mask a placeholder is harmless and is filled silently. On the mask it is an error
    that names `remedy`, unless `remedy` is None (the caller allows missing values).
    """
    missing_BT = ~torch.isfinite(values_BT)
    if remedy is not None and bool((missing_BT & mask_BT).any()):
        count = int((missing_BT & mask_BT).sum())
        raise ValueError(
            f"loss_fn_inputs[{key!r}] is NaN/inf on {count} counted token(s): {remedy}"
        )
    return torch.where(missing_BT, fallback_BT.detach(), values_BT)
