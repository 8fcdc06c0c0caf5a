"""Sampler vs trainer logprob agreement: hand values, a naive loop, and accumulation."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from posttrain.algo.agreement import AgreementSums, agreement_metrics, sample_train_agreement


def naive_metrics(
    sampler: list[float], trainer: list[float], mask: list[float]
) -> dict[str, float]:
    """The cookbook's definition, one token at a time."""
    deltas = [q - p for q, p, m in zip(sampler, trainer, mask, strict=True) if m > 0 and q == q]
    if not deltas:
        return {}
    return {
        "kl_sample_train_v1": math.fsum(deltas) / len(deltas),
        "kl_sample_train_v2": math.fsum(0.5 * d * d for d in deltas) / len(deltas),
        "logprob_diff_max": max(abs(d) for d in deltas),
        "logprob_diff_mean": math.fsum(abs(d) for d in deltas) / len(deltas),
    }


def test_hand_values_on_four_tokens():
    sampler_T = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    trainer_T = torch.tensor([-1.5, -1.0, -0.5, -9.0])
    mask_T = torch.tensor([1.0, 1.0, 1.0, 0.0])
    sums = sample_train_agreement(sampler_T, trainer_T, mask_T)
    # δ = q − p on the 3 counted tokens: 0.5, −1.0, 0.0 (the masked one, 6.0, is left out).
    # v1 = (0.5 − 1 + 0)/3 = −1/6; v2 = ½(0.25 + 1 + 0)/3 = 0.625/3; max |δ| = 1;
    # mean |δ| = (0.5 + 1 + 0)/3 = 0.5.
    assert sums == AgreementSums(
        diff_sum=-0.5, half_sq_sum=0.625, abs_max=1.0, count=3, abs_sum=1.5
    )
    assert agreement_metrics(sums) == {
        "kl_sample_train_v1": pytest.approx(-1 / 6, abs=1e-15),
        "kl_sample_train_v2": pytest.approx(0.625 / 3, abs=1e-15),
        "logprob_diff_max": 1.0,
        "logprob_diff_mean": 0.5,
    }


def test_masked_and_unknown_tokens_are_left_out():
    sampler_T = torch.tensor([-1.0, math.nan, -2.0, -4.0])
    trainer_T = torch.tensor([-1.25, -7.0, -100.0, -3.0])
    mask_T = torch.tensor([1.0, 1.0, 0.0, 1.0])
    # Counted: δ = 0.25 and −1.0 (token 1 has no sampler logprob, token 2 is masked):
    # Σ|δ| = 1.25, so mean |δ| = 0.625 while mean δ = −0.375 (signs no longer cancel).
    sums = sample_train_agreement(sampler_T, trainer_T, mask_T)
    assert sums == AgreementSums(
        diff_sum=-0.75, half_sq_sum=0.53125, abs_max=1.0, count=2, abs_sum=1.25
    )
    assert sums.abs_mean == 0.625


def test_no_counted_token_gives_no_metrics():
    nan_T = torch.full((3,), math.nan)
    assert sample_train_agreement(nan_T, torch.zeros(3), torch.ones(3)) == AgreementSums()
    assert sample_train_agreement(torch.zeros(3), torch.ones(3), torch.zeros(3)).count == 0
    assert agreement_metrics(AgreementSums()) == {}


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="must have one shape"):
        sample_train_agreement(torch.zeros(3), torch.zeros(4), torch.ones(3))


logprob = st.floats(-20.0, 0.0, allow_nan=False, width=32)
token = st.tuples(st.one_of(logprob, st.just(math.nan)), logprob, st.sampled_from([0.0, 1.0]))


@settings(max_examples=200, deadline=None)
@given(st.lists(token, min_size=1, max_size=40), st.integers(0, 40))
def test_matches_naive_loop_and_splits_add_up(tokens, cut):
    sampler, trainer, mask = (list(column) for column in zip(*tokens, strict=True))
    q_T, p_T, m_T = (torch.tensor(x, dtype=torch.float32) for x in (sampler, trainer, mask))
    whole = agreement_metrics(sample_train_agreement(q_T, p_T, m_T))
    # Float32 inputs are exact in float64, so only summation order differs: ~1e-15 relative.
    expected = naive_metrics(sampler, trainer, mask)
    assert whole.keys() == expected.keys()
    for key, value in expected.items():
        assert whole[key] == pytest.approx(value, rel=1e-12, abs=1e-12)
    # Two mini-batches add up to the token mean of the whole, not a mean of their means.
    cut = min(cut, len(tokens))
    parts = sample_train_agreement(q_T[:cut], p_T[:cut], m_T[:cut]) + sample_train_agreement(
        q_T[cut:], p_T[cut:], m_T[cut:]
    )
    for key, value in agreement_metrics(parts).items():
        assert value == pytest.approx(whole[key], rel=1e-12, abs=1e-12)
