"""Uncertainty kinds and the planning-token detector: hand values, naive loops, bad input."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algo.planning import DEFAULT_STRATEGIC_GRAMS, parse_grams, planning_mask
from posttrain.algo.uncertainty import (
    UNCERTAINTY_KINDS,
    predictive_variance,
    shannon_entropy,
    surprisal,
    token_uncertainty,
)


def test_kinds_hand_values():
    # surprisal: -log p, capped at 50: [-0.5, -100] -> [0.5, 50].
    assert surprisal([-0.5, -100.0], None) == [0.5, 50.0]
    # predictive variance p (1 - p): p = 0.25 -> 0.1875; p = 1 (logprob 0) -> 0.
    assert predictive_variance([math.log(0.25), 0.0], None) == pytest.approx([0.1875, 0.0])
    # shannon entropy: the sampler's entropies, capped at 50.
    assert shannon_entropy([-1.0, -2.0], [0.3, 60.0]) == [0.3, 50.0]


def naive_kind(kind: str, logprobs: list[float], entropies: list[float]) -> list[float]:
    out = []
    for lp, h in zip(logprobs, entropies, strict=True):
        if kind == "surprisal":
            out.append(min(-lp, 50.0))
        elif kind == "predictive_variance":
            p = math.exp(lp)
            out.append(p - p * p)
        else:
            out.append(min(h, 50.0))
    return out


@pytest.mark.parametrize("kind", sorted(UNCERTAINTY_KINDS))
def test_each_kind_matches_the_naive_per_token_loop(kind):
    gen = torch.Generator().manual_seed(1)
    logprobs = (-torch.rand(40, generator=gen, dtype=torch.float64) * 60).tolist()
    entropies = (torch.rand(40, generator=gen, dtype=torch.float64) * 60).tolist()
    got = token_uncertainty(kind, UNCERTAINTY_KINDS[kind], logprobs, entropies)
    # p - p*p and p*(1 - p) differ by an ulp or so of values <= 0.25.
    assert got.tolist() == pytest.approx(
        naive_kind(kind, logprobs, entropies), rel=1e-14, abs=1e-16
    )


def test_shannon_entropy_without_entropies_names_what_is_missing():
    with pytest.raises(ValueError, match=r"per-token entropies.*SamplingParams\(entropies=True\)"):
        token_uncertainty("shannon_entropy", shannon_entropy, [-1.0], None)


def test_a_custom_kind_of_the_wrong_length_or_values_is_refused_naming_it():
    with pytest.raises(
        ValueError, match=r"uncertainty_kind='pkg:short' returned 2 values for a completion of 3"
    ):
        token_uncertainty("pkg:short", lambda lp, h: [1.0, 2.0], [-1.0, -1.0, -1.0])
    with pytest.raises(ValueError, match=r"uncertainty_kind='pkg:neg' returned -1.0 for token 1"):
        token_uncertainty("pkg:neg", lambda lp, h: [0.0, -1.0], [-1.0, -1.0])
    with pytest.raises(ValueError, match=r"'pkg:nan' returned nan for token 0"):
        token_uncertainty("pkg:nan", lambda lp, h: [math.nan], [-1.0])
    with pytest.raises(ValueError, match="2 entropies for 1 tokens"):
        token_uncertainty("surprisal", surprisal, [-1.0], [0.1, 0.2])


def test_planning_mask_marks_exactly_the_tokens_of_a_gram():
    grams = DEFAULT_STRATEGIC_GRAMS
    tokens = [" Wait", ",", " let", " me", " check", " the", " sum"]
    # "Wait, let me check the sum": "let me check" matches; "wait let me" does not (comma).
    assert planning_mask(tokens, grams) == [0, 0, 1, 1, 1, 0, 0]
    # Pieces of one word join into it, any case: "Let me think".
    assert planning_mask(["Let", " me", " th", "ink", "."], grams) == [1, 1, 1, 1, 0]
    # Whole words only: "outlet me check" holds "let me check" inside a word.
    assert planning_mask([" outlet", " me", " check"], grams) == [0, 0, 0]
    # SentencePiece / byte-level BPE word markers count as spaces.
    assert planning_mask(["\u2581let", "\u2581me", "\u0120think"], grams) == [1, 1, 1]
    # Two matches, and whitespace runs inside a gram.
    two = [" notice", "  that", " x", " the", " key", " is"]
    assert planning_mask(two, grams) == [1, 1, 0, 1, 1, 1]
    assert planning_mask([], grams) == []


def test_strategic_grams_option_parses_and_refuses_empty_phrases():
    assert parse_grams(None) == DEFAULT_STRATEGIC_GRAMS
    grams = parse_grams("hmm,  let   me see ")
    assert grams == ("hmm", "let me see")
    assert planning_mask([" Hmm", " ok"], grams) == [1, 0]
    with pytest.raises(ValueError, match="empty phrase"):
        parse_grams("hmm,,wait")
