"""Per-token uncertainty u_t of a completion: the signal the GTPO family of token transforms
weighs credit by (`algo.token_transforms`).

A kind reads the sampler's data for the completion's trainable tokens: the sampled tokens'
logprobs, and for `shannon_entropy` the entropy of each token's sampling distribution. A
custom kind is any `UncertaintyFn` (the trainer loads one named by dotted path). Whatever the
kind, u_t must be one finite number >= 0 per token: GTPO divides by the completion's mean.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import torch

UncertaintyKind = Literal["surprisal", "predictive_variance", "shannon_entropy"]
TokenData = Literal["logprobs", "entropies"]

# retrain's cap on uncertainty values: a token of probability e^-50 is as surprising as any, and
# a sampler can report a logprob of -inf, which would poison every mean it enters.
MAX_UNCERTAINTY = 50.0

# A kind: (logprobs of the sampled tokens, entropies or None) -> one u_t per token.
UncertaintyFn = Callable[[Sequence[float], Sequence[float] | None], Sequence[float]]


def surprisal(logprobs: Sequence[float], entropies: Sequence[float] | None) -> list[float]:
    """u_t = min(-log p(y_t), 50): the sampled token's surprisal (GTPO's entropy proxy)."""
    return [min(-lp, MAX_UNCERTAINTY) for lp in logprobs]


def predictive_variance(
    logprobs: Sequence[float], entropies: Sequence[float] | None
) -> list[float]:
    """u_t = p(1 - p) with p = exp(log p(y_t)): the Bernoulli variance of the sampled token."""
    return [math.exp(lp) * (1.0 - math.exp(lp)) for lp in logprobs]


def shannon_entropy(logprobs: Sequence[float], entropies: Sequence[float] | None) -> list[float]:
    """u_t = -sum_v p_v log p_v of the distribution y_t was drawn from (sampler-computed)."""
    if entropies is None:
        raise ValueError(
            "uncertainty_kind='shannon_entropy' needs per-token entropies, and this completion "
            "has none: sample it with SamplingParams(entropies=True), on a backend whose "
            "sampler computes them (provides_token_entropies in `posttrain backends`)"
        )
    return [min(h, MAX_UNCERTAINTY) for h in entropies]


UNCERTAINTY_KINDS: dict[UncertaintyKind, UncertaintyFn] = {
    "surprisal": surprisal,
    "predictive_variance": predictive_variance,
    "shannon_entropy": shannon_entropy,
}
# The sampler data each built-in kind reads, for preflight's "what does the backend provide".
KIND_NEEDS: dict[UncertaintyKind, TokenData] = {
    "surprisal": "logprobs",
    "predictive_variance": "logprobs",
    "shannon_entropy": "entropies",
}


def token_uncertainty(
    kind: str,
    fn: UncertaintyFn,
    logprobs: Sequence[float],
    entropies: Sequence[float] | None = None,
) -> torch.Tensor:
    """u [T] (float64) of one completion by `fn`, checked: one finite value >= 0 per token.

    `kind` names the kind in errors (a custom kind's dotted path).
    """
    if entropies is not None and len(entropies) != len(logprobs):
        raise ValueError(
            f"uncertainty_kind={kind!r}: {len(entropies)} entropies for {len(logprobs)} tokens"
        )
    values = list(fn(logprobs, entropies))
    if len(values) != len(logprobs):
        raise ValueError(
            f"uncertainty_kind={kind!r} returned {len(values)} values for a completion of "
            f"{len(logprobs)} tokens; it must return one value per token"
        )
    u_T = torch.tensor(values, dtype=torch.float64)
    bad = (~torch.isfinite(u_T) | (u_T < 0)).nonzero()
    if bad.numel() > 0:
        i = int(bad[0].item())
        raise ValueError(
            f"uncertainty_kind={kind!r} returned {values[i]!r} for token {i}; an uncertainty "
            "must be a finite number >= 0"
        )
    return u_T
