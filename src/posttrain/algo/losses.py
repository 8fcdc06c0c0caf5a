"""Policy and supervised losses, chosen by name from `LOSSES` (Tinker's loss names and semantics).

Every loss is a SUM over tokens and datums: reduction (token mean, sequence mean, ...) is the
caller's choice, expressed by pre-scaling `weights` / `advantages`. This makes the gradient the
same whatever the micro-batch split, the number of forward_backward calls, or the DP size.

Notation per token t: `lp_t` the learner's logprob (with gradient), `q_t` = inputs["logprobs"]
(behaviour policy), `A_t` = inputs["advantages"], `r_t = exp(lp_t − q_t)`, `sg` stop-gradient.
Each loss returns Σ_t w_t·m_t·ℓ_t, with the weights `w` and mask `m` of `LossBatch`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from posttrain.algo.loss_checks import check_config, check_inputs, resolved_thresholds
from posttrain.algo.loss_config import (
    ART_CLIP_DEFAULTS,
    DEFAULT_THRESHOLDS,
    RATIO_LOSSES,
    REQUIRED_INPUTS,
    KLMode,
    LossBatch,
    LossConfig,
)
from posttrain.algo.loss_inputs import (
    clip_bounds,
    policy_tokens,
    sampler_logprobs,
    shaped_advantages,
    weight_and_mask,
)
from posttrain.algo.loss_output import LossOutput
from posttrain.algo.ratios import (
    ImportanceSamplingLevel,
    KLEstimator,
    importance_ratio,
    log_ratio,
    truncated_is_weight,
)
from posttrain.algo.value_loss import value

__all__ = [
    "ART_CLIP_DEFAULTS",
    "DEFAULT_THRESHOLDS",
    "LOSSES",
    "RATIO_LOSSES",
    "REQUIRED_INPUTS",
    "ImportanceSamplingLevel",
    "KLEstimator",
    "KLMode",
    "LossBatch",
    "LossConfig",
    "LossFn",
    "LossOutput",
    "check_config",
    "check_inputs",
    "cispo",
    "cross_entropy",
    "dro",
    "get_loss",
    "gspo",
    "importance_sampling",
    "ppo",
    "resolved_thresholds",
    "with_art_clip_defaults",
]

LossFn = Callable[[LossBatch, LossConfig], LossOutput]

# A policy term maps (ratio, A, lp, lo, hi) to (ℓ_t, clipped_t): the per-token loss before
# weights, and where the clip changed the token's gradient.
PolicyTerm = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    tuple[torch.Tensor, torch.Tensor],
]


def _importance_sampling_term(
    ratio_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    logp_BT: torch.Tensor,
    lo_BT: torch.Tensor,
    hi_BT: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ℓ_t = −r_t·A_t."""
    return -ratio_BT * adv_BT, torch.zeros_like(ratio_BT, dtype=torch.bool)


def _ppo_term(
    ratio_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    logp_BT: torch.Tensor,
    lo_BT: torch.Tensor,
    hi_BT: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ℓ_t = −min(r_t·A_t, clip(r_t, lo, hi)·A_t) (Schulman et al. 2017)."""
    unclipped_BT = ratio_BT * adv_BT
    clipped_BT = ratio_BT.clamp(lo_BT, hi_BT) * adv_BT
    return -torch.minimum(unclipped_BT, clipped_BT), (clipped_BT < unclipped_BT).detach()


def _cispo_term(
    ratio_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    logp_BT: torch.Tensor,
    lo_BT: torch.Tensor,
    hi_BT: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ℓ_t = −sg(clip(r_t, lo, hi))·A_t·lp_t (MiniMax-M1, 2025)."""
    ratio_BT = ratio_BT.detach()
    is_weight_BT = ratio_BT.clamp(lo_BT, hi_BT)
    return -is_weight_BT * adv_BT * logp_BT, (ratio_BT < lo_BT) | (ratio_BT > hi_BT)


def _ratio_loss(
    name: str,
    batch: LossBatch,
    config: LossConfig,
    term: PolicyTerm,
    level: ImportanceSamplingLevel,
    ratio_mask_key: str | None = None,
) -> LossOutput:
    """Σ w·m·ℓ for a ratio-based `term`, with the config's ratio options applied:

    ℓ_t = tis_t·keep_t·term_t + β_kl·k_t, where keep_t = 1[lo < r_t < hi] under mask_prob_ratio
    (ART zeroes r_t there; ℓ_t = 0 has the same gradient), tis_t the truncated IS weight, and the
    KL term present in kl_mode "loss" (in "advantage" mode it shapes A instead). With
    max_negative_advantage_importance_sampling_weight = M, r_t ← min(r_t, M) where A_t < 0 first.
    """
    check_config(name, config)
    check_inputs(name, batch.inputs.keys(), config)
    tokens = policy_tokens(batch, config, ratio_mask_key)
    ratio_BT = importance_ratio(tokens.logp_BT, tokens.old_logp_BT, tokens.ratio_mask_BT, level)
    lo_BT, hi_BT = clip_bounds(batch, *resolved_thresholds(name, config), tokens.mask_BT)
    adv_BT, kl_BT = shaped_advantages(batch, config, tokens)
    cap = config.max_negative_advantage_importance_sampling_weight
    if cap is not None:
        # Dual-clip's reason: with A < 0, PPO's min leaves r·A unbounded below as r grows.
        ratio_BT = torch.where(adv_BT < 0, ratio_BT.clamp(max=cap), ratio_BT)
    loss_BT, clipped_BT = term(ratio_BT, adv_BT, tokens.logp_BT, lo_BT, hi_BT)
    if config.mask_prob_ratio:
        kept_BT = (ratio_BT.detach() > lo_BT) & (ratio_BT.detach() < hi_BT)
        loss_BT = torch.where(kept_BT, loss_BT, 0.0)
        clipped_BT = clipped_BT | ~kept_BT
    if config.truncated_importance_sampling is not None:
        sampler_BT = sampler_logprobs(batch, config, tokens)
        cap = config.truncated_importance_sampling
        loss_BT = loss_BT * truncated_is_weight(tokens.old_logp_BT, sampler_BT, cap)
    per_token = {"ratio": ratio_BT.detach(), "clipped": clipped_BT.to(ratio_BT.dtype)}
    if kl_BT is not None:
        per_token["kl"] = kl_BT.detach()
        if config.kl_mode == "loss":
            loss_BT = loss_BT + config.kl_penalty_coef * kl_BT
    return _output(batch, tokens.weight_BT, tokens.mask_BT, loss_BT, per_token)


def _output(
    batch: LossBatch,
    weight_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    loss_BT: torch.Tensor,
    per_token: dict[str, torch.Tensor],
) -> LossOutput:
    """Σ w·m·ℓ (uncounted tokens add exactly 0, even if ℓ is not finite there) and diagnostics."""
    loss = torch.where(weight_BT != 0, weight_BT * loss_BT, 0.0).sum()
    per_token["logprobs"] = batch.logp_BT.detach()
    if batch.entropy_BT is not None:
        per_token["entropy"] = batch.entropy_BT.detach()
    return LossOutput(loss=loss, per_token=per_token, mask_BT=mask_BT)


def cross_entropy(batch: LossBatch, config: LossConfig) -> LossOutput:
    """Weighted negative log-likelihood (Tinker): ℓ_t = −lp_t; weights may be any real."""
    check_config("cross_entropy", config)
    check_inputs("cross_entropy", batch.inputs.keys(), config)
    weight_BT, mask_BT = weight_and_mask(batch)
    return _output(batch, weight_BT, mask_BT, -batch.logp_BT, {})


def importance_sampling(batch: LossBatch, config: LossConfig) -> LossOutput:
    """Importance-sampled policy gradient (Tinker): ℓ_t = −r_t·A_t."""
    level = config.importance_sampling_level
    return _ratio_loss("importance_sampling", batch, config, _importance_sampling_term, level)


def ppo(batch: LossBatch, config: LossConfig) -> LossOutput:
    """PPO clipped surrogate (Schulman et al. 2017): ℓ_t = −min(r_t·A_t, clip(r_t, lo, hi)·A_t)."""
    return _ratio_loss("ppo", batch, config, _ppo_term, config.importance_sampling_level)


def cispo(batch: LossBatch, config: LossConfig) -> LossOutput:
    """CISPO (MiniMax-M1, 2025): ℓ_t = −sg(clip(r_t, lo, hi))·A_t·lp_t."""
    return _ratio_loss("cispo", batch, config, _cispo_term, config.importance_sampling_level)


def gspo(batch: LossBatch, config: LossConfig) -> LossOutput:
    """GSPO-token (Zheng et al. 2025): ℓ_t = −min(s_t·A_t, clip(s_t, lo, hi)·A_t), with
    s_t = sg(s_b)·exp(lp_t − sg(lp_t)), s_b = exp(mean_{t∈M_b}(lp_t − q_t)).

    M is inputs["sequence_ratio_mask"] (Tinker's input, which only picks the tokens of the
    mean), else the mask.
    """
    return _ratio_loss("gspo", batch, config, _ppo_term, "sequence", "sequence_ratio_mask")


def dro(batch: LossBatch, config: LossConfig) -> LossOutput:
    """DRO as Tinker implements it (Richemond et al. 2024; Kimi Team 2025):
    ℓ_t = −(lp_t·A_t − ½·β·(lp_t − q_t)²).
    """
    check_config("dro", config)
    check_inputs("dro", batch.inputs.keys(), config)
    tokens = policy_tokens(batch, config)
    penalty_BT = 0.5 * config.dro_beta * (tokens.logp_BT - tokens.old_logp_BT) ** 2
    loss_BT = -(tokens.logp_BT * tokens.adv_BT - penalty_BT)
    ratio_BT = log_ratio(tokens.logp_BT, tokens.old_logp_BT).exp().detach()
    return _output(batch, tokens.weight_BT, tokens.mask_BT, loss_BT, {"ratio": ratio_BT})


def with_art_clip_defaults(name: str, config: LossConfig) -> LossConfig:
    """`config` with ART's clip range for loss `name` wherever it leaves epsilon or
    epsilon_high None (each defaults alone, as in ART); other losses keep `config`."""
    if name not in ART_CLIP_DEFAULTS:
        return config
    default_eps, default_eps_high = ART_CLIP_DEFAULTS[name]
    eps = default_eps if config.epsilon is None else config.epsilon
    eps_high = config.epsilon_high
    if eps_high is None:
        eps_high = eps if default_eps_high is None else default_eps_high
    return replace(config, epsilon=eps, epsilon_high=eps_high)


LOSSES: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
    "value": value,
}


def get_loss(name: str) -> LossFn:
    """The loss registered as `name`."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; valid losses: {', '.join(LOSSES)}")
    return LOSSES[name]
