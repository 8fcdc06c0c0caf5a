"""A naive per-token reference for the losses of `algo.losses`, written from their formulas.

Loops over tokens with one 0-d float64 tensor per learner logprob (an autograd leaf), so
autograd on the reference gives the reference gradient. Stop-gradients are written where the
formulas put them: sg(lp) for unknown behaviour logprobs, CISPO's clipped ratio, GSPO's s_b,
Kimi K2's τ-correction, the TIS weight (a constant) and ART's KL advantage shaping.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from loss_helpers import SPEC_THRESHOLDS, Row

from posttrain.algo.losses import LossConfig

Scalar = torch.Tensor  # 0-d float64


def naive_loss(
    name: str, rows: Sequence[Row], keys: Sequence[str], config: LossConfig
) -> tuple[Scalar, float, list[list[Scalar]]]:
    """(Σ w·ℓ, Σ |w·ℓ|, the lp leaves of each row): the summed loss, its scale for relative
    comparisons (the loss itself may cancel to ~0), and the leaves to read gradients from.
    """
    total, scale = torch.zeros((), dtype=torch.float64), 0.0
    leaves: list[list[Scalar]] = []
    for row in rows:
        lp = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in row["lp"]]
        leaves.append(lp)
        n = len(lp)
        w = row["weights"] if "weights" in keys else [1.0] * n
        if "mask" in keys:
            m = [x != 0 for x in row["mask"]]
        else:
            m = [x != 0 for x in w] if "weights" in keys else [True] * n
        terms = (
            _policy_row(name, row, lp, keys, config, m)
            if name != "cross_entropy"
            else [-x for x in lp]
        )
        for t in range(n):
            if m[t] and w[t] != 0:
                total = total + w[t] * terms[t]
                scale += abs(w[t] * terms[t].item())
    return total, scale, leaves


def naive_loss_and_grad(
    name: str, rows: Sequence[Row], keys: Sequence[str], config: LossConfig, width: int
) -> tuple[float, float, torch.Tensor]:
    """(Σ w·ℓ, Σ |w·ℓ|, d loss / d lp as a [B, width] float64 tensor, 0 on padding)."""
    total, scale, leaves = naive_loss(name, rows, keys, config)
    if total.requires_grad:  # else no token counts: the gradient is 0
        total.backward()
    grad = torch.zeros(len(leaves), width, dtype=torch.float64)
    for b, row in enumerate(leaves):
        for t, leaf in enumerate(row):
            if leaf.grad is not None:
                grad[b, t] = leaf.grad
    return total.item(), scale, grad


def _kl(lp: Scalar, ref: float, estimator: str) -> Scalar:
    """Schulman's k1 = lp − ref, k3 = e^x − x − 1 with x = ref − lp (clamped to ±20)."""
    if estimator == "k1":
        return lp - ref
    x = torch.clamp(ref - lp, -20.0, 20.0)
    return torch.exp(x) - x - 1


def _policy_term(
    name: str, r: Scalar, adv: Scalar | float, lp: Scalar, lo: float, hi: float
) -> Scalar:
    if name == "importance_sampling":
        return -r * adv
    if name in ("ppo", "gspo"):
        return -torch.minimum(r * adv, torch.clamp(r, lo, hi) * adv)
    return -torch.clamp(r.detach(), lo, hi) * adv * lp  # cispo: the clipped ratio is a constant


def _ratio(level: str, delta: Scalar, seq: Scalar, lp: Scalar) -> Scalar:
    """Token ratio e^Δ, GSPO-token s = sg(s_b)·e^{lp − sg(lp)}, or their means."""
    token = torch.exp(delta)
    s = torch.exp(seq + lp - lp.detach())
    if level == "token":
        return token
    if level == "sequence":
        return s
    if level == "average":
        return (token + s) / 2
    return torch.sqrt(token * s)  # geometric_average


def _policy_row(
    name: str, row: Row, lp: list[Scalar], keys: Sequence[str], config: LossConfig, m: list[bool]
) -> list[Scalar]:
    """ℓ_t of one row for the policy losses."""
    n = len(lp)
    # An unknown behaviour logprob (allowed) is sg(lp): ratio 1, no gradient through q.
    q = [lp[t].detach() if math.isnan(row["logprobs"][t]) else row["logprobs"][t] for t in range(n)]
    delta = [torch.clamp(lp[t] - q[t], -20.0, 20.0) for t in range(n)]
    seq_m = [x != 0 for x in row["sequence_ratio_mask"]] if "sequence_ratio_mask" in keys else m
    zero = torch.zeros((), dtype=torch.float64)
    seq = sum((delta[t].detach() for t in range(n) if seq_m[t]), zero) / max(sum(seq_m), 1)
    adv: list[Scalar | float] = list(row["advantages"])
    if config.kimi_k2_tau is not None:
        adv = [adv[t] - config.kimi_k2_tau * delta[t].detach() for t in range(n)]
    kl = [_kl(lp[t], row["ref_logprobs"][t], config.kl_estimator) for t in range(n)]
    if config.kl_penalty_coef > 0 and config.kl_mode == "advantage":
        kl_mean = sum((kl[t].detach() for t in range(n) if m[t]), zero) / max(sum(m), 1)
        shaping = [config.kl_penalty_coef * (kl_mean - kl[t].detach()) * m[t] for t in range(n)]
        adv = [adv[t] + shaping[t] for t in range(n)]
    if name == "dro":
        return [-(lp[t] * adv[t] - 0.5 * config.dro_beta * (lp[t] - q[t]) ** 2) for t in range(n)]
    lo, hi = SPEC_THRESHOLDS[name]
    eps_high = config.epsilon if config.epsilon_high is None else config.epsilon_high
    lo = lo if config.epsilon is None else 1 - config.epsilon
    hi = hi if eps_high is None else 1 + eps_high
    level = "sequence" if name == "gspo" else config.importance_sampling_level
    terms: list[Scalar] = []
    for t in range(n):
        lo_t = row["clip_low_threshold"][t] if "clip_low_threshold" in keys else lo
        hi_t = row["clip_high_threshold"][t] if "clip_high_threshold" in keys else hi
        r = _ratio(level, delta[t], seq, lp[t])
        term = _policy_term(name, r, adv[t], lp[t], lo_t, hi_t)
        if config.mask_prob_ratio and not lo_t < r.item() < hi_t:
            term = zero
        if config.truncated_importance_sampling is not None:
            is_weight = math.exp(float(q[t]) - row["sampler_logprobs"][t])
            term = term * min(is_weight, config.truncated_importance_sampling)
        if config.kl_penalty_coef > 0 and config.kl_mode == "loss":
            term = term + config.kl_penalty_coef * kl[t]
        terms.append(term)
    return terms
