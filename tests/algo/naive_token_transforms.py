"""Naive per-token references for `algo.token_transforms`: Python floats, one token at a time,
written from the formulas (retrain's documented pipeline), not from the torch implementation."""

from __future__ import annotations

import math


def naive_gtpo(adv: float, u: list[float], beta: float) -> list[float]:
    h = [min(x, 50.0) for x in u]
    if not h or beta == 0:
        return [adv] * len(h)
    mean = sum(h) / len(h)
    if mean < 1e-7:
        return [adv] * len(h)
    out = []
    for x in h:
        w = 1.0 + beta * (x / (mean + 1e-8) - 1.0)
        out.append(adv * max(0.0, w))
    return out


def naive_hicra(a: list[float], plan: list[int], alpha: float) -> list[float]:
    return [x + alpha * abs(x) if p else x for x, p in zip(a, plan, strict=True)]


def naive_sepa_pool(u: list[float], plan: list[int], lam: float) -> list[float]:
    h = [min(x, 50.0) for x in u]
    execs = [x for x, p in zip(h, plan, strict=True) if not p]
    if lam == 0 or not execs:
        return h
    mean = sum(execs) / len(execs)
    return [x if p else lam * mean + (1 - lam) * x for x, p in zip(h, plan, strict=True)]


def naive_threshold(values: list[float], rho: float) -> float:
    ordered = sorted(values, reverse=True)
    k = max(1, math.floor(rho * len(values) + 1e-9))
    return ordered[k - 1]


def naive_group(
    transform: str,
    adv: list[float],
    u: list[list[float]],
    plan: list[list[int]],
    *,
    beta: float,
    alpha: float,
    lam: float,
    rho: float,
) -> list[list[float]]:
    """Per-token advantages of one group, completion by completion."""
    out = []
    for a, u_i, p_i in zip(adv, u, plan, strict=True):
        if transform == "none":
            out.append([a] * len(u_i))
        elif transform == "gtpo_sepa":
            out.append(naive_gtpo(a, naive_sepa_pool(u_i, p_i, lam), beta))
        elif transform == "gtpo_hicra":
            out.append(naive_hicra(naive_gtpo(a, u_i, beta), p_i, alpha))
        else:
            out.append(naive_gtpo(a, u_i, beta))
    if transform == "entropy_mask":
        threshold = naive_threshold([x for u_i in u for x in u_i], rho)
        out = [
            [x if v >= threshold else 0.0 for x, v in zip(a_i, u_i, strict=True)]
            for a_i, u_i in zip(out, u, strict=True)
        ]
    return out


def naive_whiten(values: list[float]) -> list[float]:
    n = len(values)
    mean = sum(values) / n
    sigma = math.sqrt(sum((v - mean) ** 2 for v in values) / n)
    if sigma < 1e-8:
        return [v - mean for v in values]
    return [(v - mean) / (sigma + 1e-8) for v in values]
