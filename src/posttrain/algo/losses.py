"""Policy and supervised losses, chosen by name from `LOSSES` (Tinker's loss names and semantics).

Every loss is a SUM over tokens and datums: reduction (token mean, sequence mean, ...) is the
caller's choice, expressed by pre-scaling `weights` / `advantages`. This makes the gradient the
same whatever the micro-batch split, the number of forward_backward calls, or the DP size.

Notation per token t: `lp_t` the learner's logprob (with gradient), `q_t` = inputs["logprobs"]
(behaviour policy), `A_t` = inputs["advantages"], `r_t = exp(lp_t − q_t)`, `sg` stop-gradient.
Each loss returns Σ_t w_t·m_t·ℓ_t, with the weights `w` and mask `m` of `LossBatch`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Literal

import torch

from posttrain.algo.config_fields import (
    ConfigValue,
    check_choice,
    check_number,
    read_choice,
    read_flag,
    read_number,
    read_optional_number,
    reject_unknown_keys,
)
from posttrain.algo.loss_checks import (
    DEFAULT_THRESHOLDS,
    RATIO_LOSSES,
    REQUIRED_INPUTS,
    THRESHOLD_KEYS,
    check_config,
    check_inputs,
    check_shapes,
    resolved_thresholds,
)
from posttrain.algo.loss_inputs import (
    clip_bounds,
    policy_tokens,
    sampler_logprobs,
    shaped_advantages,
    weight_and_mask,
)
from posttrain.algo.ratios import (
    IMPORTANCE_SAMPLING_LEVELS,
    KL_ESTIMATORS,
    ImportanceSamplingLevel,
    KLEstimator,
    importance_ratio,
    log_ratio,
    truncated_is_weight,
)

__all__ = [
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
]

KLMode = Literal["loss", "advantage"]
KL_MODES: tuple[KLMode, ...] = ("loss", "advantage")

_EPSILON_KEYS = ("epsilon", "epsilon_high")


@dataclass(frozen=True)
class LossConfig:
    """Options of the policy losses. `None` thresholds take each loss's default."""

    clip_low_threshold: float | None = None
    clip_high_threshold: float | None = None
    beta: float = 0.05  # dro's quadratic penalty
    importance_sampling_level: ImportanceSamplingLevel = "token"
    truncated_importance_sampling: float | None = None
    mask_prob_ratio: bool = False
    kimi_k2_tau: float | None = None
    kl_penalty_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    kl_mode: KLMode = "loss"
    allow_missing_logprobs: bool = False

    def __post_init__(self) -> None:
        lo, hi = self.clip_low_threshold, self.clip_high_threshold
        check_number("clip_low_threshold", lo, "a ratio bound >= 0", lambda v: v >= 0)
        check_number("clip_high_threshold", hi, "a ratio bound > 0", lambda v: v > 0)
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"clip_low_threshold ({lo}) must be <= clip_high_threshold ({hi})")
        check_number("beta", self.beta, ">= 0", lambda v: v >= 0)
        cap = self.truncated_importance_sampling
        check_number("truncated_importance_sampling", cap, "a cap U > 0", lambda v: v > 0)
        check_number("kimi_k2_tau", self.kimi_k2_tau, ">= 0", lambda v: v >= 0)
        check_number("kl_penalty_coef", self.kl_penalty_coef, ">= 0", lambda v: v >= 0)
        levels = IMPORTANCE_SAMPLING_LEVELS
        check_choice("importance_sampling_level", self.importance_sampling_level, levels)
        check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        check_choice("kl_mode", self.kl_mode, KL_MODES)

    @classmethod
    def from_mapping(cls, values: Mapping[str, ConfigValue]) -> LossConfig:
        """Build from Tinker's `loss_fn_config` or a TOML table; a None value means the default.

        Also takes ART's `epsilon`/`epsilon_high`: lo = 1 − ε, hi = 1 + ε_high, ε_high
        defaulting to ε; a mapping gives either these or the thresholds, not both.
        """
        reject_unknown_keys(
            values, [f.name for f in fields(cls)] + list(_EPSILON_KEYS), "loss config"
        )
        lo, hi = clip_thresholds(values)
        return cls(
            clip_low_threshold=lo,
            clip_high_threshold=hi,
            beta=read_number(values, "beta", cls.beta),
            importance_sampling_level=read_choice(
                values,
                "importance_sampling_level",
                IMPORTANCE_SAMPLING_LEVELS,
                cls.importance_sampling_level,
            ),
            truncated_importance_sampling=read_optional_number(
                values, "truncated_importance_sampling", cls.truncated_importance_sampling
            ),
            mask_prob_ratio=read_flag(values, "mask_prob_ratio", cls.mask_prob_ratio),
            kimi_k2_tau=read_optional_number(values, "kimi_k2_tau", cls.kimi_k2_tau),
            kl_penalty_coef=read_number(values, "kl_penalty_coef", cls.kl_penalty_coef),
            kl_estimator=read_choice(values, "kl_estimator", KL_ESTIMATORS, cls.kl_estimator),
            kl_mode=read_choice(values, "kl_mode", KL_MODES, cls.kl_mode),
            allow_missing_logprobs=read_flag(
                values, "allow_missing_logprobs", cls.allow_missing_logprobs
            ),
        )


def clip_thresholds(values: Mapping[str, ConfigValue]) -> tuple[float | None, float | None]:
    """(clip_low_threshold, clip_high_threshold) from either form of a config mapping."""
    given = [key for key in (*_EPSILON_KEYS, *THRESHOLD_KEYS) if values.get(key) is not None]
    if not any(key in _EPSILON_KEYS for key in given):
        low, high = THRESHOLD_KEYS
        return read_optional_number(values, low, None), read_optional_number(values, high, None)
    if any(key in THRESHOLD_KEYS for key in given):
        raise ValueError(
            f"give the clip range as clip_low_threshold/clip_high_threshold or as "
            f"epsilon/epsilon_high, not both (got {given})"
        )
    eps = read_optional_number(values, "epsilon", None)
    eps_high = read_optional_number(values, "epsilon_high", eps)
    check_number(
        "epsilon", eps, "in [0, 1] (clip_low_threshold = 1 − epsilon)", lambda v: 0 <= v <= 1
    )
    check_number(
        "epsilon_high", eps_high, ">= 0 (clip_high_threshold = 1 + epsilon_high)", lambda v: v >= 0
    )
    return (None if eps is None else 1 - eps), (None if eps_high is None else 1 + eps_high)


@dataclass(frozen=True)
class LossBatch:
    """Padded per-token tensors of one micro-batch; padding has weights 0 and mask 0.

    `logp_BT` is the learner's log p(target) and carries the gradient. `inputs` holds the
    datums' `loss_fn_inputs` padded to [B, T]: `target_tokens`, and as the loss needs them
    `weights`, `advantages`, `logprobs` (behaviour policy), `mask`, `sampler_logprobs`,
    `ref_logprobs`, per-token `clip_low_threshold`/`clip_high_threshold`. `entropy_BT` (no
    gradient) is optional, for diagnostics only.

    Weights `w` default to 1 on real tokens. The mask `m` (inputs["mask"]; else weights ≠ 0 if
    weights are given; else the real tokens) marks the tokens that count: it gates the loss and
    picks the tokens of sequence means (gspo: inputs["sequence_ratio_mask"] if given), KL
    centring, missing-logprob checks and diagnostics. Sequence-level ratios and KL need a mask or
    weights that leave out prompt tokens, whose `logprobs` are placeholders.
    """

    logp_BT: torch.Tensor
    inputs: Mapping[str, torch.Tensor]
    pad_mask_BT: torch.Tensor
    entropy_BT: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_shapes(self.logp_BT, self.inputs, self.pad_mask_BT, self.entropy_BT)


@dataclass(frozen=True)
class LossOutput:
    """The summed loss (scalar, with gradient), detached per-token diagnostics [B, T], and the
    mask of the tokens the loss counted (for `algo.loss_metrics.summarize`).
    """

    loss: torch.Tensor
    per_token: Mapping[str, torch.Tensor] = field(default_factory=lambda: dict[str, torch.Tensor]())
    mask_BT: torch.Tensor | None = None


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
    KL term present in kl_mode "loss" (in "advantage" mode it shapes A instead).
    """
    check_config(name, config)
    check_inputs(name, batch.inputs.keys(), config)
    tokens = policy_tokens(batch, config, ratio_mask_key)
    ratio_BT = importance_ratio(tokens.logp_BT, tokens.old_logp_BT, tokens.ratio_mask_BT, level)
    lo_BT, hi_BT = clip_bounds(batch, *resolved_thresholds(name, config), tokens.mask_BT)
    adv_BT, kl_BT = shaped_advantages(batch, config, tokens)
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
    penalty_BT = 0.5 * config.beta * (tokens.logp_BT - tokens.old_logp_BT) ** 2
    loss_BT = -(tokens.logp_BT * tokens.adv_BT - penalty_BT)
    ratio_BT = log_ratio(tokens.logp_BT, tokens.old_logp_BT).exp().detach()
    return _output(batch, tokens.weight_BT, tokens.mask_BT, loss_BT, {"ratio": ratio_BT})


LOSSES: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
}


def get_loss(name: str) -> LossFn:
    """The loss registered as `name`."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; valid losses: {', '.join(LOSSES)}")
    return LOSSES[name]
