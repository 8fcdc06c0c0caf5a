"""Group-relative advantages, advantage balancing, and loss reductions as per-token weights.

Advantages are one scalar per completion, computed within its group (the completions of one
prompt). Reductions (token mean, sequence mean, constant) become per-token weights so that the
SUM loss of `algo.losses` equals the chosen mean whatever the micro-batch or data-parallel split.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch

from posttrain.algo.config_fields import POSITIVE, Check, check_fields, group, option
from posttrain.algo.sepa import SEPAConfig
from posttrain.algo.token_transforms import TokenTransform, TokenTransformConfig

# Each estimator but "gae" works from a group's rewards alone (`ADVANTAGE_ESTIMATORS`); "gae"
# reads a learned critic's per-token values (`algo.gae`, run by `trainer.critic`), so only
# backends with a critic take it.
GroupEstimator = Literal["grpo", "rloo", "dr_grpo", "maxrl", "reinforce_pp"]
AdvantageEstimator = Literal[GroupEstimator, "gae"]
# retrain's fixed recipes, <estimator>_<transform>. retrain's grpo centres without dividing
# by the std, which is posttrain's dr_grpo.
AlgorithmMode = Literal[
    "grpo_none",
    "maxrl_none",
    "maxrl_gtpo",
    "maxrl_gtpo_hicra",
    "maxrl_gtpo_sepa",
    "reinforce_pp_none",
    "reinforce_pp_gtpo",
    "reinforce_pp_gtpo_sepa",
]
ALGORITHM_MODES: dict[AlgorithmMode, tuple[AdvantageEstimator, TokenTransform]] = {
    "grpo_none": ("dr_grpo", "none"),
    "maxrl_none": ("maxrl", "none"),
    "maxrl_gtpo": ("maxrl", "gtpo"),
    "maxrl_gtpo_hicra": ("maxrl", "gtpo_hicra"),
    "maxrl_gtpo_sepa": ("maxrl", "gtpo_sepa"),
    "reinforce_pp_none": ("reinforce_pp", "none"),
    "reinforce_pp_gtpo": ("reinforce_pp", "gtpo"),
    "reinforce_pp_gtpo_sepa": ("reinforce_pp", "gtpo_sepa"),
}
ZeroVarianceMode = Literal["drop", "keep"]
ReductionPreset = Literal["token_mean", "sequence_mean", "constant", "sum"]
REDUCTION_PRESETS: tuple[ReductionPreset, ...] = ("token_mean", "sequence_mean", "constant", "sum")

# ART's threshold: rewards closer than this to the first one count as equal.
ZERO_VARIANCE_TOL = 1e-12
# grpo's std + eps denominator in every step (group_advantages takes another for direct use).
ADVANTAGE_EPS = 1e-6

EstimatorFn = Callable[[torch.Tensor, bool, float], torch.Tensor]


def _grpo(r_G: torch.Tensor, scale_rewards: bool, eps: float) -> torch.Tensor:
    """GRPO (Shao et al. 2024, DeepSeekMath): A_i = (r_i - mean r) / (std r + eps), population std."""
    adv_G = r_G - r_G.mean()
    if not scale_rewards:
        return adv_G
    return adv_G / (r_G.std(correction=0) + eps)


def _dr_grpo(r_G: torch.Tensor, scale_rewards: bool, eps: float) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): A_i = r_i - mean r."""
    return r_G - r_G.mean()


def _rloo(r_G: torch.Tensor, scale_rewards: bool, eps: float) -> torch.Tensor:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024): A_i = r_i - mean_{j != i} r_j."""
    n = r_G.numel()
    # r_i - (sum r - r_i)/(n-1) = (r_i - mean r) * n/(n-1); callers guarantee n >= 2.
    return (r_G - r_G.mean()) * (n / (n - 1))


def _maxrl(r_G: torch.Tensor, scale_rewards: bool, eps: float) -> torch.Tensor:
    """MaxRL, as retrain's and SkyRL's `maxrl` estimators: A_i = (r_i - mean r) / (mean r + eps);
    all zeros when mean r <= eps (retrain's rule).
    """
    mean = r_G.mean()
    if mean.item() <= eps:
        return torch.zeros_like(r_G)
    return (r_G - mean) / (mean + eps)


def _reinforce_pp(r_G: torch.Tensor, scale_rewards: bool, eps: float) -> torch.Tensor:
    """REINFORCE++ with a group baseline (Hu 2025): A_i = r_i - mean r here; the trainer then
    whitens every completion token's advantage over the whole batch (`token_transforms.whiten`).
    """
    return r_G - r_G.mean()


# `scale_rewards` only affects "grpo": the other estimators fix their own scaling.
ADVANTAGE_ESTIMATORS: dict[str, EstimatorFn] = {
    "grpo": _grpo,
    "rloo": _rloo,
    "dr_grpo": _dr_grpo,
    "maxrl": _maxrl,
    "reinforce_pp": _reinforce_pp,
}


def _check_rewards(rewards_G: torch.Tensor, name: str) -> None:
    if rewards_G.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(rewards_G.shape)}")
    if rewards_G.numel() == 0:
        raise ValueError(f"{name} is empty: a group needs at least one reward")
    bad = (~torch.isfinite(rewards_G)).nonzero()
    if bad.numel() > 0:
        i = int(bad[0].item())
        raise ValueError(f"{name}[{i}] is {rewards_G[i].item()}; rewards must be finite")


def _check_eps(eps: float) -> None:
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite number > 0, got {eps}")


def _check_estimator(estimator: str) -> None:
    if estimator == "gae":
        raise ValueError(
            "gae advantages come from a critic's per-token values (trainer.critic), not from a "
            "group's rewards alone"
        )
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"estimator must be one of {list(ADVANTAGE_ESTIMATORS)}, got {estimator!r}"
        )


def is_zero_variance(rewards_G: torch.Tensor, tol: float = ZERO_VARIANCE_TOL) -> bool:
    """True if the group has at most one reward or every |r_i - r_0| <= tol (no learning signal)."""
    if rewards_G.numel() <= 1:
        return True
    r_G = rewards_G.to(torch.float64)
    return bool(((r_G - r_G[0]).abs() <= tol).all().item())


def group_advantages(
    rewards_G: torch.Tensor,
    *,
    estimator: AdvantageEstimator = "grpo",
    scale_rewards: bool = True,
    eps: float = ADVANTAGE_EPS,
) -> torch.Tensor:
    """One advantage per completion of a group; all zeros for a zero-variance group.

    Computed in float64 and returned in the rewards' float dtype (the default dtype for integer
    or bool rewards). `scale_rewards` (divide by the population std + eps) applies to "grpo" only.
    """
    _check_estimator(estimator)
    _check_eps(eps)
    _check_rewards(rewards_G, "rewards_G")
    dtype = rewards_G.dtype if rewards_G.is_floating_point() else torch.get_default_dtype()
    if is_zero_variance(rewards_G):
        return torch.zeros(rewards_G.shape, dtype=dtype, device=rewards_G.device)
    adv_G = ADVANTAGE_ESTIMATORS[estimator](rewards_G.to(torch.float64), scale_rewards, eps)
    return adv_G.to(dtype)


def _check_balance(balance: float, name: str) -> None:
    if not (math.isfinite(balance) and -1.0 <= balance <= 1.0):
        raise ValueError(f"{name} must be in [-1, 1], got {balance}")


def balance_advantages(adv: torch.Tensor, balance: float) -> torch.Tensor:
    """ART's advantage_balance b: b > 0 scales A < 0 by (1 - b); b < 0 scales A > 0 by (1 + b)."""
    _check_balance(balance, "balance")
    if balance > 0:
        return torch.where(adv < 0, adv * (1.0 - balance), adv)
    if balance < 0:
        return torch.where(adv > 0, adv * (1.0 + balance), adv)
    return adv.clone()


@dataclass(frozen=True)
class AdvantageConfig:
    """How a step turns group rewards into advantages and per-token loss weights, each field a
    `train()` option of the same name; zero-variance groups are dropped by default."""

    advantage_estimator: AdvantageEstimator = option(
        "grpo",
        "group baseline: grpo, dr_grpo (no std), rloo, maxrl, reinforce_pp (centred, then "
        "whitened over the batch's completion tokens); gae: PPO with a learned critic "
        "(backends with a critic)",
    )
    algorithm_mode: AlgorithmMode | None = option(
        None,
        "a retrain recipe <estimator>_<transform> (e.g. maxrl_gtpo_sepa; grpo means dr_grpo): "
        "sets advantage_estimator and token_transform",
    )
    scale_rewards: bool = option(True, "divide grpo advantages by the group's reward std")
    zero_variance_groups: ZeroVarianceMode = option(
        "drop", "drop or keep groups whose rewards are all equal (counted either way)"
    )
    advantage_balance: float = option(
        0.0,
        "in [-1, 1]: >0 down-weights negative advantages, <0 positive ones",
        Check("in [-1, 1]", lambda v: -1 <= v <= 1),
    )
    loss_reduction: ReductionPreset = option(
        "token_mean", "token_mean (DAPO), sequence_mean (GRPO), constant (Dr. GRPO), or sum"
    )
    loss_reduction_constant: float | None = option(
        None, "normaliser for loss_reduction='constant'", POSITIVE
    )
    tokens: TokenTransformConfig = group(TokenTransformConfig)
    sepa: SEPAConfig = group(SEPAConfig)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.loss_reduction == "constant" and self.loss_reduction_constant is None:
            raise ValueError(
                "option loss_reduction_constant is needed by loss_reduction='constant': "
                "pass loss_reduction_constant > 0"
            )
        if self.algorithm_mode is not None:
            self._read_algorithm_mode(self.algorithm_mode)
        if self.advantage_estimator == "gae" and self.tokens.token_transform != "none":
            raise ValueError(
                f"advantage_estimator='gae' gives every token its own advantage already; "
                f"token_transform={self.tokens.token_transform!r} spreads an episode advantage "
                "over tokens: pass one of them"
            )

    def _read_algorithm_mode(self, mode: AlgorithmMode) -> None:
        """Resolve the alias once: the mode's estimator and transform become the fields (the
        mode itself stays, for messages that name what was given)."""
        estimator, transform = ALGORITHM_MODES[mode]
        # A value at its default cannot be told from one left out: only others conflict.
        for key, value, implied, default in (
            ("advantage_estimator", self.advantage_estimator, estimator, "grpo"),
            ("token_transform", self.tokens.token_transform, transform, "none"),
        ):
            if value not in (implied, default):
                raise ValueError(
                    f"options algorithm_mode={mode!r} and {key}={value!r} "
                    f"disagree (the mode means {key}={implied!r}): pass only one of them"
                )
        object.__setattr__(self, "advantage_estimator", estimator)
        object.__setattr__(self, "tokens", replace(self.tokens, token_transform=transform))


@dataclass(frozen=True)
class AdvantageResult:
    """Per-group advantages (float64) with which groups to train on, and counts for reporting."""

    advantages: list[torch.Tensor]
    kept: list[bool]
    zero_variance: list[bool]

    @property
    def num_groups(self) -> int:
        return len(self.advantages)

    @property
    def num_zero_variance_groups(self) -> int:
        return sum(self.zero_variance)

    @property
    def num_dropped_groups(self) -> int:
        return self.num_groups - sum(self.kept)


def compute_group_advantages(
    groups_rewards: Sequence[Sequence[float]], config: AdvantageConfig
) -> AdvantageResult:
    """Advantages of every group, then `advantage_balance`; zero-variance groups marked dropped.

    Balancing per completion equals ART's per-token balancing, since every token of a completion
    carries the same advantage.
    """
    advantages: list[torch.Tensor] = []
    kept: list[bool] = []
    zero_variance: list[bool] = []
    for g, rewards in enumerate(groups_rewards):
        rewards_G = torch.tensor(list(rewards), dtype=torch.float64)
        try:
            adv_G = group_advantages(
                rewards_G,
                estimator=config.advantage_estimator,
                scale_rewards=config.scale_rewards,
                eps=ADVANTAGE_EPS,
            )
        except ValueError as err:
            raise ValueError(f"groups_rewards[{g}]: {err}") from err
        is_flat = is_zero_variance(rewards_G)
        advantages.append(balance_advantages(adv_G, config.advantage_balance))
        zero_variance.append(is_flat)
        kept.append(not (is_flat and config.zero_variance_groups == "drop"))
    return AdvantageResult(advantages=advantages, kept=kept, zero_variance=zero_variance)


def _check_mask(mask_BT: torch.Tensor) -> torch.Tensor:
    if mask_BT.dim() != 2:
        raise ValueError(f"mask_BT must be 2-D [B, T], got shape {tuple(mask_BT.shape)}")
    dtype = mask_BT.dtype if mask_BT.is_floating_point() else torch.get_default_dtype()
    mask = mask_BT.to(dtype)
    if not bool((torch.isfinite(mask) & (mask >= 0)).all().item()):
        raise ValueError("mask_BT must be finite and >= 0")
    return mask


def _global_count(local: float, override: float | None, name: str) -> float:
    """The whole mini-batch's count: `override` if given (checked against this part), else local."""
    if override is None:
        return local
    if not (math.isfinite(override) and override > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {override}")
    # A part of the mini-batch cannot hold more than the whole; the slack absorbs fp32 sums.
    if override < local * (1 - 1e-6):
        raise ValueError(
            f"{name}={override} is less than this mask_BT's own count {local}; it must be the "
            f"whole mini-batch's count, >= any part's"
        )
    return override


def _sequence_mean_weights(mask: torch.Tensor, num_sequences: int | None) -> torch.Tensor:
    """w_{i,t} = m_{i,t} / (B * sum_t m_{i,t}) with B the number of non-empty sequences."""
    tokens_B = mask.sum(dim=1)
    nonempty_B = tokens_B > 0
    if num_sequences is not None and not (
        math.isfinite(num_sequences) and int(num_sequences) == num_sequences > 0
    ):
        raise ValueError(f"num_sequences must be an int > 0, got {num_sequences!r}")
    n_seq = _global_count(int(nonempty_B.sum().item()), num_sequences, "num_sequences")
    if n_seq == 0:
        return torch.zeros_like(mask)
    # Empty rows divide 0 by 1 rather than by 0.
    per_row_B = torch.where(nonempty_B, tokens_B, torch.ones_like(tokens_B))
    return mask / (n_seq * per_row_B[:, None])


def reduction_weights(
    mask_BT: torch.Tensor,
    preset: ReductionPreset,
    *,
    num_sequences: int | None = None,
    total_tokens: float | None = None,
    constant: float | None = None,
) -> torch.Tensor:
    """Per-token weights w [B, T] such that sum_{i,t} w_{i,t} * loss_{i,t} is the chosen mean.

    - token_mean (DAPO, Yu et al. 2025): w = m / sum(m).
    - sequence_mean (GRPO, Shao et al. 2024): w_{i,t} = m_{i,t} / (B * sum_t m_{i,t}), where B
      counts sequences with at least one token: empty rows (padding, fully masked completions)
      get weight 0 and never change the loss.
    - constant (Dr. GRPO, Liu et al. 2025): w = m / constant, typically B * max_len.
    - sum: w = m.

    The normalisers (sum(m), B) must be those of the WHOLE mini-batch: the mini-batch is later
    split into micro-batches and data-parallel shards whose summed losses must add up to the
    mini-batch loss. They are derived from `mask_BT`; a caller holding only part of the
    mini-batch passes the global `total_tokens` / `num_sequences`.
    """
    if preset not in REDUCTION_PRESETS:
        raise ValueError(f"preset must be one of {list(REDUCTION_PRESETS)}, got {preset!r}")
    for name, value, owner in (
        ("total_tokens", total_tokens, "token_mean"),
        ("num_sequences", num_sequences, "sequence_mean"),
        ("constant", constant, "constant"),
    ):
        if value is not None and preset != owner:
            raise ValueError(f"{name} applies to preset {owner!r} only, got preset {preset!r}")
    mask = _check_mask(mask_BT)
    if preset == "token_mean":
        total = _global_count(float(mask.sum().item()), total_tokens, "total_tokens")
        return mask / total if total > 0 else torch.zeros_like(mask)
    if preset == "sequence_mean":
        return _sequence_mean_weights(mask, num_sequences)
    if preset == "constant":
        if constant is None or not (math.isfinite(constant) and constant > 0):
            raise ValueError(
                f"constant must be a finite number > 0 for preset 'constant', got {constant}"
            )
        return mask / constant
    return mask.clone()
