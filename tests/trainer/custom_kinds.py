"""Custom uncertainty kinds, named by dotted path ('custom_kinds:squared') in the tests."""

from __future__ import annotations

from collections.abc import Sequence


def squared(logprobs: Sequence[float], entropies: Sequence[float] | None) -> list[float]:
    """u_t = (log p_t)^2."""
    return [lp * lp for lp in logprobs]


def short(logprobs: Sequence[float], entropies: Sequence[float] | None) -> list[float]:
    """One value too few: must be refused, naming the kind."""
    return [1.0] * (len(logprobs) - 1)


def entropy_gap(logprobs: Sequence[float], entropies: Sequence[float] | None) -> list[float]:
    """|H_t + log p_t|: reads the sampler's entropies, and says so."""
    if entropies is None:
        raise ValueError("entropy_gap needs entropies")
    return [abs(h + lp) for h, lp in zip(entropies, logprobs, strict=True)]


entropy_gap.needs_entropies = True  # pyright: ignore[reportFunctionMemberAccess]

NOT_A_FUNCTION = 3
