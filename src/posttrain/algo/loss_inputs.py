"""The per-token inputs of the losses in `algo.losses`, read from a `LossBatch`.

Weights and mask with their defaults, behaviour logprobs with missing values resolved,
per-token clip bounds, and advantages after Kimi K2's correction and KL shaping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from posttrain.algo.ratios import kl_estimate, kl_shaped_advantages, known_logprobs, log_ratio

if TYPE_CHECKING:
    from posttrain.algo.loss_config import LossBatch, LossConfig


@dataclass(frozen=True)
class PolicyTokens:
    """One micro-batch in the learner's dtype, with padding and missing logprobs resolved."""

    logp_BT: torch.Tensor  # learner's logprobs, with gradient
    old_logp_BT: torch.Tensor  # behaviour policy q; sg(lp) where unknown and allowed
    adv_BT: torch.Tensor  # 0 off the mask
    weight_BT: torch.Tensor  # w·m, each token's factor in the summed loss
    mask_BT: torch.Tensor  # bool, the tokens that count
    ratio_mask_BT: torch.Tensor  # bool, the tokens of sequence-level ratios


def float_input(batch: LossBatch, key: str) -> torch.Tensor:
    """inputs[key] in the learner's dtype and device."""
    return batch.inputs[key].to(batch.logp_BT)


def _pad_mask(batch: LossBatch) -> torch.Tensor:
    """The real (non-padding) tokens."""
    return batch.pad_mask_BT.to(batch.logp_BT.device) != 0


def _mask_input(batch: LossBatch, key: str) -> torch.Tensor:
    """inputs[key] ≠ 0 on real tokens."""
    return _pad_mask(batch) & (batch.inputs[key].to(batch.logp_BT.device) != 0)


def weight_and_mask(batch: LossBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(w·m, m): w = weights, else 1 on real tokens; m = inputs["mask"], else weights ≠ 0 when
    weights are given, else the real tokens. Padding is never counted.
    """
    pad_BT = _pad_mask(batch)
    has_weights = "weights" in batch.inputs
    weight_BT = (
        torch.where(pad_BT, float_input(batch, "weights"), 0.0)
        if has_weights
        else pad_BT.to(batch.logp_BT.dtype)
    )
    if "mask" in batch.inputs:
        mask_BT = _mask_input(batch, "mask")
    else:
        mask_BT = weight_BT != 0 if has_weights else pad_BT
    return torch.where(mask_BT, weight_BT, 0.0), mask_BT


def missing_remedy(config: LossConfig) -> str | None:
    """What to tell a caller whose logprobs are missing, or None if missing ones are allowed."""
    if config.allow_training_without_logprobs:
        return None
    return (
        "pass them on every counted token, or set allow_training_without_logprobs=True "
        "(ratio 1 there)"
    )


def policy_tokens(
    batch: LossBatch, config: LossConfig, ratio_mask_key: str | None = None
) -> PolicyTokens:
    """Weights, masks, behaviour logprobs (missing ones -> sg(lp)) and advantages of `batch`.

    The ratio mask is inputs[ratio_mask_key] when given (gspo's `sequence_ratio_mask`, which in
    Tinker only picks the tokens of the sequence ratio), else the mask.
    """
    weight_BT, mask_BT = weight_and_mask(batch)
    ratio_mask_BT = mask_BT
    if ratio_mask_key is not None and ratio_mask_key in batch.inputs:
        ratio_mask_BT = _mask_input(batch, ratio_mask_key)
    old_BT = known_logprobs(
        float_input(batch, "logprobs"),
        batch.logp_BT,
        mask_BT | ratio_mask_BT,
        "logprobs",
        missing_remedy(config),
    )
    adv_BT = torch.where(mask_BT, float_input(batch, "advantages"), 0.0)
    return PolicyTokens(batch.logp_BT, old_BT, adv_BT, weight_BT, mask_BT, ratio_mask_BT)


def clip_bounds(
    batch: LossBatch, low: float, high: float, mask_BT: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (lo, hi): `low`/`high`, overridden by the per-token loss_fn_inputs of the same
    names that Tinker accepts.
    """
    bounds: list[torch.Tensor] = []
    for key, default in (("clip_low_threshold", low), ("clip_high_threshold", high)):
        bound_BT = torch.full_like(batch.logp_BT.detach(), default)
        if key in batch.inputs:
            bound_BT = torch.where(mask_BT, float_input(batch, key), bound_BT)
        bounds.append(bound_BT)
    lo_BT, hi_BT = bounds
    if bool((mask_BT & ~((lo_BT >= 0) & (lo_BT <= hi_BT))).any()):
        raise ValueError(
            "per-token clip bounds must satisfy 0 <= clip_low_threshold <= clip_high_threshold "
            "on every counted token"
        )
    return lo_BT, hi_BT


def shaped_advantages(
    batch: LossBatch, config: LossConfig, tokens: PolicyTokens
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Advantages after the τ-correction and KL shaping, and the per-token KL (None when off).

    Kimi K2's τ as ART applies it (Kimi Team 2025): A_t − τ·sg(lp_t − q_t).
    """
    adv_BT = tokens.adv_BT
    if config.kimi_k2_tau is not None:
        delta_BT = log_ratio(tokens.logp_BT.detach(), tokens.old_logp_BT)
        adv_BT = adv_BT - config.kimi_k2_tau * delta_BT
    if config.kl_penalty_coef == 0:
        return adv_BT, None
    ref_BT = known_logprobs(
        float_input(batch, "ref_logprobs"),
        tokens.logp_BT,
        tokens.mask_BT,
        "ref_logprobs",
        "pass the reference policy's logprobs on every counted token",
    )
    kl_BT = kl_estimate(tokens.logp_BT, ref_BT, config.kl_estimator)
    if config.kl_mode == "advantage":
        adv_BT = kl_shaped_advantages(adv_BT, kl_BT, tokens.mask_BT, config.kl_penalty_coef)
    return adv_BT, kl_BT


def sampler_logprobs(batch: LossBatch, config: LossConfig, tokens: PolicyTokens) -> torch.Tensor:
    """The rollout engine's logprobs; where unknown (and allowed), q itself, so TIS weighs 1."""
    return known_logprobs(
        float_input(batch, "sampler_logprobs"),
        tokens.old_logp_BT,
        tokens.mask_BT,
        "sampler_logprobs",
        missing_remedy(config),
    )
