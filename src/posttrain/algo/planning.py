"""Planning tokens: the tokens of a completion where it reasons about its own approach
("wait let me", "let me check", ...), found by a regex detector over the decoded tokens.

HICRA (Wang et al. 2025, "Emergent Hierarchical Reasoning in LLMs through Reinforcement
Learning") boosts their credit; SEPA pools the uncertainty of the other (execution) tokens.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

# retrain's default strategic grams.
DEFAULT_STRATEGIC_GRAMS: tuple[str, ...] = (
    "wait let me",
    "let me think",
    "on second thought",
    "let me check",
    "let me verify",
    "is this right",
    "double check",
    "try another approach",
    "go back and",
    "start over",
    "that's not right",
    "that doesn't work",
    "another way to",
    "or we could",
    "what if we",
    "notice that",
    "the key is",
    "the key insight",
)
# Word-start markers some tokenizers leave in a decoded piece (SentencePiece, byte-level BPE).
SUBWORD_MARKERS = ("\u2581", "\u0120")


def parse_grams(text: str | None) -> tuple[str, ...]:
    """The grams of the `strategic_grams` option: comma-separated phrases; None: the defaults."""
    if text is None:
        return DEFAULT_STRATEGIC_GRAMS
    grams = tuple(" ".join(g.split()) for g in text.split(","))
    if not grams or any(not g for g in grams):
        raise ValueError(
            f"strategic_grams={text!r} has an empty phrase; give comma-separated phrases such "
            "as 'let me check, wait'"
        )
    return grams


@functools.cache
def _pattern(grams: tuple[str, ...]) -> re.Pattern[str]:
    # Any run of whitespace between a gram's words, whole words only, any case.
    alternatives = (r"\s+".join(re.escape(word) for word in g.split()) for g in grams)
    return re.compile(r"\b(?:" + "|".join(alternatives) + r")\b", re.IGNORECASE)


def planning_mask(token_texts: Sequence[str], grams: Sequence[str]) -> list[int]:
    """1 for each token whose text overlaps a strategic gram, else 0.

    `token_texts` are the tokens of one sampled run, each decoded alone; their concatenation
    is the run's text. Unlike retrain's sliding window, which also marks the tokens before a
    match inside its window, exactly the tokens that spell a gram are marked.
    """
    pieces = [_clean(t) for t in token_texts]
    mask = [0] * len(pieces)
    if not pieces or not grams:
        return mask
    ends: list[int] = []  # character end of each token in the joined text
    position = 0
    for piece in pieces:
        position += len(piece)
        ends.append(position)
    text = "".join(pieces)
    token = 0
    for match in _pattern(tuple(grams)).finditer(text):
        start, stop = match.span()
        while ends[token] <= start:  # matches come in order: the token cursor only advances
            token += 1
        t = token
        while t < len(pieces) and ends[t] - len(pieces[t]) < stop:
            if pieces[t]:
                mask[t] = 1
            t += 1
    return mask


def _clean(piece: str) -> str:
    for marker in SUBWORD_MARKERS:
        piece = piece.replace(marker, " ")
    return piece
