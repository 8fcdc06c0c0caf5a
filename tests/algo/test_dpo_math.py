"""algo.dpo: DPO's sigmoid loss and IPO against hand-derived pairs (value and gradient w.r.t.
the token logprobs), a naive float implementation, and bad input.

Tolerances: the hand-derived values are exact to float32 rounding (~1e-7 relative); 1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.algo.dpo import AVERAGES_TOKENS, PAIR_LOSSES, pair_loss, sequence_logp

TOL = 1e-6


def pair_from_tokens(
    chosen_T: torch.Tensor,
    rejected_T: torch.Tensor,
    ref_chosen_T: torch.Tensor,
    ref_rejected_T: torch.Tensor,
    beta: float,
    loss: str,
):
    average = AVERAGES_TOKENS[loss]
    ones = torch.ones

    def seq(x: torch.Tensor) -> torch.Tensor:
        return sequence_logp(x, ones(x.shape), average).reshape(1)

    return pair_loss(
        seq(chosen_T),
        seq(rejected_T),
        seq(ref_chosen_T),
        seq(ref_rejected_T),
        beta,
        loss,  # pyright: ignore[reportArgumentType]
    )


def test_sigmoid_loss_and_gradient_by_hand():
    # chosen: policy [-1, -2] (sum -3), ref [-1.5, -2] (sum -3.5): +0.5
    # rejected: policy [-1, -3] (sum -4), ref [-2, -1.5] (sum -3.5): -0.5
    # logratio = 0.5 - (-0.5) = 1; beta = 0.5: loss = -log σ(0.5) = log(1 + e^-0.5) = 0.474077
    # ∂loss/∂lp (each chosen token) = -β·σ(-β·logratio) = -0.5·σ(-0.5) = -0.5·0.377541 = -0.188770
    # each rejected token: +0.188770. Rewards β·Δ: chosen 0.25, rejected -0.25, margin 0.5.
    chosen = torch.tensor([-1.0, -2.0], requires_grad=True)
    rejected = torch.tensor([-1.0, -3.0], requires_grad=True)
    out = pair_from_tokens(
        chosen, rejected, torch.tensor([-1.5, -2.0]), torch.tensor([-2.0, -1.5]), 0.5, "sigmoid"
    )
    out.loss_B.sum().backward()
    assert out.loss_B.item() == pytest.approx(math.log(1 + math.exp(-0.5)), rel=TOL)
    assert out.loss_B.item() == pytest.approx(0.474077, abs=1e-6)
    assert chosen.grad.tolist() == pytest.approx([-0.188770] * 2, abs=1e-6)  # pyright: ignore[reportOptionalMemberAccess]
    assert rejected.grad.tolist() == pytest.approx([0.188770] * 2, abs=1e-6)  # pyright: ignore[reportOptionalMemberAccess]
    sums = out.metric_sums()
    assert sums["rewards/chosen"] == pytest.approx(0.25, rel=TOL)
    assert sums["rewards/rejected"] == pytest.approx(-0.25, rel=TOL)
    assert sums["rewards/margin"] == pytest.approx(0.5, rel=TOL)
    assert sums["rewards/accuracy"] == 1.0


def test_ipo_loss_and_gradient_by_hand_on_averaged_logprobs():
    # IPO averages each completion's logprobs over its tokens (as TRL), so lengths differ here.
    # chosen (3 tokens): policy mean -1, ref mean -1.5: +0.5
    # rejected (2 tokens): policy mean -2, ref mean -1.5: -0.5
    # logratio = 1; beta = 0.25: target 1/(2β) = 2; loss = (1 - 2)² = 1
    # ∂loss/∂logratio = 2·(1 - 2) = -2; each chosen token: -2/3; each rejected token: +2/2 = +1
    chosen = torch.tensor([-1.0, -1.0, -1.0], requires_grad=True)
    rejected = torch.tensor([-2.0, -2.0], requires_grad=True)
    out = pair_from_tokens(
        chosen, rejected, torch.full((3,), -1.5), torch.full((2,), -1.5), 0.25, "ipo"
    )
    out.loss_B.sum().backward()
    assert out.loss_B.item() == pytest.approx(1.0, rel=TOL)
    assert chosen.grad.tolist() == pytest.approx([-2 / 3] * 3, rel=TOL)  # pyright: ignore[reportOptionalMemberAccess]
    assert rejected.grad.tolist() == pytest.approx([1.0] * 2, rel=TOL)  # pyright: ignore[reportOptionalMemberAccess]
    sums = out.metric_sums()
    assert sums["rewards/chosen"] == pytest.approx(0.125, rel=TOL)  # 0.25 · 0.5
    assert sums["rewards/margin"] == pytest.approx(0.25, rel=TOL)


def naive(
    chosen: list[float],
    rejected: list[float],
    ref_chosen: list[float],
    ref_rejected: list[float],
    beta: float,
    loss: str,
) -> float:
    """The papers' formulas on Python floats."""

    def seq(xs: list[float]) -> float:
        return sum(xs) / len(xs) if loss == "ipo" else sum(xs)

    logratio = (seq(chosen) - seq(ref_chosen)) - (seq(rejected) - seq(ref_rejected))
    if loss == "ipo":
        return (logratio - 1 / (2 * beta)) ** 2
    return math.log1p(math.exp(-beta * logratio))


logprobs = st.lists(st.floats(-8.0, 0.0, width=32), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(
    chosen=logprobs,
    rejected=logprobs,
    shift=st.floats(-1.0, 1.0),
    beta=st.floats(0.05, 2.0),
    loss=st.sampled_from(sorted(PAIR_LOSSES)),
)
def test_matches_the_naive_formulas(chosen, rejected, shift, beta, loss):
    ref_chosen = [x + shift for x in chosen]
    ref_rejected = [x - shift / 2 for x in rejected]
    c, r, rc, rr = (
        torch.tensor(x, dtype=torch.float64) for x in (chosen, rejected, ref_chosen, ref_rejected)
    )
    out = pair_from_tokens(c, r, rc, rr, beta, loss)
    want = naive(chosen, rejected, ref_chosen, ref_rejected, beta, loss)
    assert out.loss_B.item() == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_at_the_reference_sigmoid_is_log2_and_ipo_the_squared_target():
    zero = torch.zeros(3)
    sigmoid = pair_loss(zero, zero, zero, zero, 0.1, "sigmoid")
    ipo = pair_loss(zero, zero, zero, zero, 0.1, "ipo")
    assert sigmoid.loss_B.tolist() == pytest.approx([math.log(2)] * 3, rel=TOL)
    assert ipo.loss_B.tolist() == pytest.approx([25.0] * 3, rel=TOL)  # (0 - 1/0.2)²
    assert sigmoid.metric_sums()["rewards/accuracy"] == 0.0  # a tie is not a win


def test_beta_must_be_positive():
    zero = torch.zeros(1)
    with pytest.raises(ValueError, match="beta must be > 0"):
        pair_loss(zero, zero, zero, zero, 0.0, "sigmoid")
