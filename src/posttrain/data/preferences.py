"""Preference pairs for DPO: a prompt with a chosen and a rejected completion, on exact tokens.

`PreferencePair` holds token ids; `posttrain.rollouts.dpo_data.preference_pair_from_chat`
builds one from chat messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PreferencePair:
    """One prompt and two completions of it, `chosen` preferred over `rejected`."""

    prompt: tuple[int, ...]
    chosen: tuple[int, ...]
    rejected: tuple[int, ...]


def check_pairs(pairs: Sequence[PreferencePair]) -> None:
    """Raise ValueError naming the pair and field of the first bad pair (or an empty list)."""
    if not pairs:
        raise ValueError("train_dpo() got no preference pairs; pass at least one PreferencePair")
    for index, pair in enumerate(pairs):
        if not isinstance(pair, PreferencePair):
            raise TypeError(f"pair {index} is a {type(pair).__name__}, not a PreferencePair")
        for name in ("prompt", "chosen", "rejected"):
            if not getattr(pair, name):
                raise ValueError(f"pair {index} has an empty {name}: it needs at least one token")
        if pair.chosen == pair.rejected:
            raise ValueError(
                f"pair {index} has identical chosen and rejected completions: nothing to prefer"
            )
