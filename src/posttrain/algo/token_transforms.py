"""Token transforms: from one advantage per completion to one per token (retrain's pipeline).

A transform spreads a completion's episode advantage A over its tokens by their uncertainty
u_t (`algo.uncertainty`), with h_t = min(u_t, 50):
- none: a_t = A.
- gtpo (GTPO, Tan et al. 2025, "GTPO and GRPO-S: Token and Sequence-Level Reward Shaping with
  Policy Entropy"): w_t = max(0, 1 + beta (h_t / (mean h + 1e-8) - 1)), a_t = A w_t; uniform
  when beta = 0 or mean h < 1e-7.
- gtpo_hicra (HICRA, Wang et al. 2025): gtpo, then a_t += alpha |a_t| on planning tokens.
- gtpo_sepa (retrain's SEPA): before gtpo, each execution (non-planning) token's h_t becomes
  lambda mean(h_exec) + (1 - lambda) h_t; planning tokens keep theirs.
- entropy_mask (Wang et al. 2025, "Beyond the 80/20 Rule"): gtpo, then only the tokens whose
  u_t is among the top rho of the group's keep their advantage; the rest get 0.

Every mean is over ONE completion's tokens (as retrain): mean_t w_t = 1 whenever no weight is
clipped at 0, so a transform moves credit between the tokens of a completion without changing
the completion's mean advantage, which the episode estimator set.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from posttrain.algo.config_fields import NON_NEGATIVE, Check, check_fields, option
from posttrain.algo.planning import parse_grams
from posttrain.algo.uncertainty import MAX_UNCERTAINTY, UNCERTAINTY_KINDS
from posttrain.finder import did_you_mean

TokenTransform = Literal["none", "gtpo", "gtpo_hicra", "gtpo_sepa", "entropy_mask"]
TOKEN_TRANSFORMS: tuple[TokenTransform, ...] = get_args(TokenTransform)
NEEDS_PLANNING: frozenset[TokenTransform] = frozenset({"gtpo_hicra", "gtpo_sepa"})
GTPO_EPS = 1e-8  # in w_t's denominator
GTPO_FLAT = 1e-7  # mean h below this: nothing to weigh by, weights stay 1
WHITEN_EPS = 1e-8  # reinforce_pp's batch normalisation: (a - mu) / (sigma + eps)


def check_uncertainty_kind(kind: str) -> None:
    """A built-in kind or a dotted path 'package.module:function'; else the nearest built-in."""
    if kind in UNCERTAINTY_KINDS or ":" in kind:
        return
    raise ValueError(
        f"option uncertainty_kind={kind!r} is invalid{did_you_mean(kind, UNCERTAINTY_KINDS)} (one of {list(UNCERTAINTY_KINDS)}, "
        "or a custom kind as 'package.module:function')"
    )


@dataclass(frozen=True)
class TokenTransformConfig:
    """Options of the token transform (retrain's transform_mode and its parameters)."""

    token_transform: TokenTransform = option(
        "none",
        "spread each completion's advantage over its tokens: none, gtpo, gtpo_hicra, "
        "gtpo_sepa, entropy_mask",
    )
    uncertainty_kind: str = option(
        "surprisal",
        "the per-token signal of the gtpo family: surprisal, predictive_variance, "
        "shannon_entropy (needs sampler entropies), or 'package.module:function'",
    )
    gtpo_beta: float = option(0.1, "gtpo: how strongly uncertainty reweighs credit", NON_NEGATIVE)
    hicra_alpha: float = option(
        0.2, "gtpo_hicra: planning tokens get a_t + alpha * |a_t|", NON_NEGATIVE
    )
    entropy_mask_rho: float = option(
        0.2,
        "entropy_mask: the fraction of each group's tokens, most uncertain first, that keep "
        "their advantage",
        Check("in (0, 1]", lambda v: 0 < v <= 1),
    )
    strategic_grams: str | None = option(
        None,
        "gtpo_hicra / gtpo_sepa: comma-separated phrases that mark planning tokens "
        "(None: retrain's 18 defaults)",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        check_uncertainty_kind(self.uncertainty_kind)
        try:
            parse_grams(self.strategic_grams)
        except ValueError as exc:
            raise ValueError(f"option {exc}") from None


def gtpo_weights(u_T: torch.Tensor, beta: float) -> torch.Tensor:
    """w_t = max(0, 1 + beta (h_t / (mean h + 1e-8) - 1)), h_t = min(u_t, 50)."""
    h_T = u_T.clamp(max=MAX_UNCERTAINTY)
    if beta == 0 or h_T.numel() == 0:
        return torch.ones_like(h_T)
    mean = float(h_T.mean())
    if mean < GTPO_FLAT:
        return torch.ones_like(h_T)
    return (1.0 + beta * (h_T / (mean + GTPO_EPS) - 1.0)).clamp(min=0.0)


def hicra(adv_T: torch.Tensor, plan_T: torch.Tensor, alpha: float) -> torch.Tensor:
    """a_t + alpha |a_t| on planning tokens (plan_t = 1), a_t elsewhere."""
    return adv_T + alpha * adv_T.abs() * plan_T


def sepa_pool(u_T: torch.Tensor, plan_T: torch.Tensor, lam: float) -> torch.Tensor:
    """Execution tokens' h_t -> lambda mean(h_exec) + (1 - lambda) h_t, h_t = min(u_t, 50);
    planning tokens unchanged. The mean is over this completion's execution tokens."""
    h_T = u_T.clamp(max=MAX_UNCERTAINTY)
    exec_T = plan_T == 0
    if lam == 0 or not bool(exec_T.any()):
        return h_T
    mean = h_T[exec_T].mean()
    return torch.where(exec_T, lam * mean + (1.0 - lam) * h_T, h_T)


def top_rho_threshold(u_N: torch.Tensor, rho: float) -> float:
    """The k-th largest value, k = max(1, floor(rho N)): values >= it are the top rho."""
    # The slack keeps rho * N from flooring one short in floating point (0.3 * 10 = 2.99..).
    k = max(1, math.floor(rho * u_N.numel() + 1e-9))
    return float(torch.topk(u_N, k).values[-1])


@dataclass(frozen=True)
class GroupTokens:
    """One group's completions: episode advantages, uncertainties, planning masks."""

    adv_G: Sequence[float]
    u_G: Sequence[torch.Tensor]  # [T_i] per completion, float64
    plan_G: Sequence[torch.Tensor] | None  # [T_i] 0/1 per completion; None: no planning tokens


def transform_group(
    group: GroupTokens,
    transform: TokenTransform,
    *,
    beta: float,
    alpha: float = 0.0,
    lam: float = 0.0,
    rho: float = 1.0,
) -> tuple[list[torch.Tensor], int]:
    """Per-token advantages of each completion of a group, and how many tokens entropy_mask
    zeroed (0 for the other transforms)."""
    if len(group.u_G) != len(group.adv_G):
        raise ValueError(f"{len(group.adv_G)} advantages for {len(group.u_G)} completions")
    if transform in NEEDS_PLANNING and group.plan_G is None:
        raise ValueError(f"token_transform={transform!r} needs planning masks")
    out: list[torch.Tensor] = []
    for i, (adv, u_T) in enumerate(zip(group.adv_G, group.u_G, strict=True)):
        plan_T = group.plan_G[i] if group.plan_G is not None else torch.zeros_like(u_T)
        if transform == "none":
            out.append(torch.full_like(u_T, adv))
        elif transform == "gtpo_sepa":
            out.append(adv * gtpo_weights(sepa_pool(u_T, plan_T, lam), beta))
        else:
            a_T = adv * gtpo_weights(u_T, beta)
            out.append(hicra(a_T, plan_T, alpha) if transform == "gtpo_hicra" else a_T)
    if transform != "entropy_mask" or not out:
        return out, 0
    threshold = top_rho_threshold(torch.cat(list(group.u_G)), rho)
    masked = [
        torch.where(u_T >= threshold, a_T, 0.0) for u_T, a_T in zip(group.u_G, out, strict=True)
    ]
    return masked, sum(int((u_T < threshold).sum()) for u_T in group.u_G)


def whiten(adv_N: torch.Tensor) -> torch.Tensor:
    """REINFORCE++ (Hu 2025) batch normalisation: (a - mu) / (sigma + 1e-8) over the batch's
    completion tokens (population sigma); only centred when sigma < 1e-8."""
    if adv_N.numel() == 0:
        return adv_N.clone()
    centred = adv_N - adv_N.mean()
    sigma = float(adv_N.std(correction=0))
    return centred if sigma < WHITEN_EPS else centred / (sigma + WHITEN_EPS)
