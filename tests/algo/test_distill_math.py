"""algo.distill: per-token advantages teacher − student logprob, the mixed-in task advantage,
the mask, and the reverse-KL estimate; by hand, against a naive loop, and as properties.

Tolerances: float64 arithmetic on a few numbers, compared at 1e-12 (exact up to rounding).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.algo.distill import ReverseKLSums, distill_advantages, reverse_kl_sums


def naive_advantages(
    student: list[float], teacher: list[float], mask: list[float], adv: float, coef: float
) -> list[float]:
    out = []
    for lp, q, m in zip(student, teacher, mask, strict=True):
        out.append((q - lp) + coef * adv if m > 0 else 0.0)
    return out


def test_advantages_and_kl_by_hand():
    # Targets: a prompt token (mask 0, no student logprob) then three sampled tokens.
    student = torch.tensor([math.nan, -0.5, -2.0, -1.0])
    teacher = torch.tensor([-3.0, -0.25, -0.5, -1.5])
    mask = torch.tensor([0.0, 1.0, 1.0, 1.0])
    # q − lp: -0.25+0.5 = 0.25; -0.5+2.0 = 1.5; -1.5+1.0 = -0.5; the prompt token 0.
    adv = distill_advantages(student, teacher, mask)
    assert adv.tolist() == pytest.approx([0.0, 0.25, 1.5, -0.5], abs=1e-12)
    # Mixed with task advantage A = 2 at c = 0.5: each trainable token + 1.
    mixed = distill_advantages(student, teacher, mask, reward_adv=2.0, reward_coef=0.5)
    assert mixed.tolist() == pytest.approx([0.0, 1.25, 2.5, 0.5], abs=1e-12)
    # Reverse KL: Σ(lp − q) = -0.25 - 1.5 + 0.5 = -1.25 over 3 tokens.
    sums = reverse_kl_sums(student, teacher, mask)
    assert (sums.total, sums.count) == (pytest.approx(-1.25, abs=1e-12), 3)
    assert sums.mean == pytest.approx(-1.25 / 3, abs=1e-12)


def test_equal_models_give_zero_advantage_and_kl():
    logp = torch.tensor([-0.1, -2.3, -0.7])
    mask = torch.ones(3)
    assert distill_advantages(logp, logp.clone(), mask).abs().max() == 0
    assert reverse_kl_sums(logp, logp.clone(), mask).mean == 0


def test_sums_add_up_across_trajectories():
    a = ReverseKLSums(1.0, 2) + ReverseKLSums(-4.0, 3)
    assert (a.total, a.count, a.mean) == (-3.0, 5, -0.6)
    assert ReverseKLSums().mean == 0.0


def test_a_trainable_token_without_a_logprob_is_an_error():
    mask = torch.tensor([1.0, 1.0])
    with pytest.raises(ValueError, match="no teacher logprob"):
        distill_advantages(torch.tensor([-1.0, -1.0]), torch.tensor([-1.0, math.nan]), mask)
    with pytest.raises(ValueError, match="no student logprob"):
        reverse_kl_sums(torch.tensor([math.nan, -1.0]), torch.tensor([-1.0, -1.0]), mask)
    with pytest.raises(ValueError, match="one shape"):
        distill_advantages(torch.zeros(2), torch.zeros(3), torch.ones(2))


logprob = st.floats(min_value=-20.0, max_value=0.0, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(logprob, logprob, st.booleans()), min_size=1, max_size=12),
    st.floats(min_value=-3.0, max_value=3.0),
    st.floats(min_value=0.0, max_value=2.0),
)
def test_matches_the_naive_loop(rows, adv, coef):
    student, teacher, trainable = zip(*rows, strict=True)
    mask = [1.0 if m else 0.0 for m in trainable]
    got = distill_advantages(
        torch.tensor(student),
        torch.tensor(teacher),
        torch.tensor(mask),
        reward_adv=adv,
        reward_coef=coef,
    )
    # The inputs arrive as float32 tensors: compare with the naive loop on those same values.
    s32, t32 = torch.tensor(student).tolist(), torch.tensor(teacher).tolist()
    assert got.tolist() == pytest.approx(naive_advantages(s32, t32, mask, adv, coef), abs=1e-9)
    # Pure distillation: the token mean of the advantages is minus the reverse-KL estimate.
    sums = reverse_kl_sums(torch.tensor(student), torch.tensor(teacher), torch.tensor(mask))
    pure = distill_advantages(torch.tensor(student), torch.tensor(teacher), torch.tensor(mask))
    assert sums.count == sum(trainable)
    assert float(pure.sum()) == pytest.approx(-sums.total, abs=1e-9)
