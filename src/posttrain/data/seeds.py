"""Seeds derived from a run's seed and names: stable across processes and interpreters (unlike
`hash`), so a step, a prompt or an episode draws the same whatever runs beside it. Rollouts,
jobs and the sampling engines all derive theirs here."""

from __future__ import annotations

import hashlib


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from `parts`, stable across processes (unlike `hash`)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def prompt_seed(seed: int | None, index: int) -> int | None:
    """A seed for prompt `index` of a batch, so a prompt samples the same tokens whatever
    else is in the batch (vLLM seeds per request)."""
    return None if seed is None else derive_seed(seed, index)
