"""(c) Gradients of the losses of `algo.losses` wrt the learner's logprobs, where the math gives
them in closed form; each expected gradient is derived in a comment.

Notation per token: lp the learner's logprob, q the behaviour logprob, Δ = lp − q, r = e^Δ,
A the advantage, w the weight; d r / d lp = r. Rows come from `seeded_rows` (ratios in e^±0.6,
some zero weights), in float64: the expected values are the same exps and products in another
order, so 1e-12 relative (and 1e-15 absolute, for gradients of exactly 0) bounds the rounding.
"""

from __future__ import annotations

import pytest
import torch
from loss_helpers import Row, W, column, on_policy, run, seeded_rows

from posttrain.algo.losses import LossConfig


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "gspo", "cispo"])
def test_on_policy_gradient_is_minus_weight_times_advantage(name: str, seed: int):
    # r = exp(0) = 1 exactly, inside every default clip band: d loss/d lp_t = −w_t·A_t, bit-exact.
    rows = on_policy(seeded_rows(seed))
    _, grad, _ = run(name, rows, W)
    width = grad.shape[1]
    expected = -column(rows, "weights", width) * column(rows, "advantages", width)
    assert torch.equal(grad, expected)


@pytest.mark.parametrize("seed", range(3))
def test_cross_entropy_gradient_is_minus_weight(seed: int):
    rows = seeded_rows(seed)
    _, grad, _ = run("cross_entropy", rows, ["weights"])
    assert torch.equal(grad, -column(rows, "weights", grad.shape[1]))


@pytest.mark.parametrize("seed", range(3))
def test_cispo_gradient_is_minus_weight_clipped_ratio_advantage(seed: int):
    # cispo off-policy: the IS weight is detached, so d/dlp_t = −w·clip(r, lo, hi)·A exactly.
    rows = seeded_rows(seed)
    config = LossConfig(epsilon=0.1, epsilon_high=0.1)  # binds for e^±0.6
    _, grad, _ = run("cispo", rows, W, config)
    width = grad.shape[1]
    w, adv = column(rows, "weights", width), column(rows, "advantages", width)
    ratio = (column(rows, "lp", width) - column(rows, "logprobs", width)).exp()
    # 1e-12: exp of the same difference, rounding order only
    torch.testing.assert_close(grad, -w * ratio.clamp(0.9, 1.1) * adv, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("seed", range(3))
def test_dro_gradient(seed: int):
    # d/dlp −(lp·A − ½β(lp − q)²) = −(A − β(lp − q)), times w.
    rows = seeded_rows(seed)
    _, grad, _ = run("dro", rows, W, LossConfig(dro_beta=0.7))
    width = grad.shape[1]
    w, adv = column(rows, "weights", width), column(rows, "advantages", width)
    delta = column(rows, "lp", width) - column(rows, "logprobs", width)
    torch.testing.assert_close(grad, -w * (adv - 0.7 * delta), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", ["ppo", "gspo"])
def test_off_policy_clipped_gradient(name: str, seed: int):
    # d/dlp_t −min(x_t·A, clip(x_t)·A) = −w·A·x_t where the unclipped term is the min, else 0;
    # x_t = r_t for ppo, x_t = s_b (the row's sequence ratio) for gspo.
    rows = seeded_rows(seed)
    config = LossConfig(epsilon=0.1, epsilon_high=0.1)
    _, grad, _ = run(name, rows, W, config)
    width = grad.shape[1]
    w, adv = column(rows, "weights", width), column(rows, "advantages", width)
    delta = column(rows, "lp", width) - column(rows, "logprobs", width)
    if name == "gspo":
        counted = (w != 0).double()
        delta = (
            (delta * counted).sum(1, keepdim=True) / counted.sum(1, keepdim=True).clamp(min=1)
        ).expand_as(delta)
    x = delta.exp()
    active = (x * adv < x.clamp(0.9, 1.1) * adv) | (x == x.clamp(0.9, 1.1))
    assert bool((~active).any()) and bool(active.any())  # both branches are exercised
    torch.testing.assert_close(grad, torch.where(active, -w * adv * x, 0.0), rtol=1e-12, atol=1e-15)


# -------------------------------------------------------------------------- (d) invariance


def _tokens(rows: list[Row], width: int) -> dict[str, torch.Tensor]:
    """w, A, Δ = lp − q and r = e^Δ of `rows` as [B, width] float64 tensors (0 on padding)."""
    delta = column(rows, "lp", width) - column(rows, "logprobs", width)
    return {
        "w": column(rows, "weights", width),
        "adv": column(rows, "advantages", width),
        "delta": delta,
        "ratio": delta.exp(),
    }


@pytest.mark.parametrize("seed", range(3))
def test_importance_sampling_off_policy_gradient(seed: int):
    # ℓ = −r·A with r = e^{lp − q}: d ℓ / d lp = −A·dr/dlp = −A·r; times w. No clip: every token
    # keeps its gradient, whatever r is (here r in e^±0.6, far from 1).
    rows = seeded_rows(seed)
    _, grad, _ = run("importance_sampling", rows, W)
    x = _tokens(rows, grad.shape[1])
    assert bool((x["ratio"] - 1).abs().max() > 0.1)  # off-policy indeed
    torch.testing.assert_close(grad, -x["w"] * x["adv"] * x["ratio"], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", ["importance_sampling", "cispo"])
def test_kimi_k2_tau_gradient(name: str, seed: int):
    # Kimi K2: A' = A − τ·sg(Δ), a constant per token, so the loss is the plain one with A'.
    #   importance_sampling: ℓ = −r·A'          -> d ℓ / d lp = −r·(A − τΔ)
    #   cispo (hi = 4 never binds for r <= e^0.6): ℓ = −sg(r)·A'·lp -> d ℓ / d lp = −r·(A − τΔ)
    # times w. A gradient through τΔ would add +τ·r (is) or +τ·r·lp (cispo) per token.
    rows = seeded_rows(seed)
    tau = 0.5
    _, grad, _ = run(name, rows, W, LossConfig(kimi_k2_tau=tau))
    x = _tokens(rows, grad.shape[1])
    expected = -x["w"] * x["ratio"] * (x["adv"] - tau * x["delta"])
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("seed", range(3))
def test_truncated_importance_sampling_gradient(seed: int):
    # TIS weight c = min(e^{q − s}, U) with s the sampler's logprob: a constant multiplier (it
    # depends on q and s only, and is detached), so ℓ = −c·r·A -> d ℓ / d lp = −c·A·r, times w.
    rows = seeded_rows(seed)
    cap = 1.2  # e^{q − s} spans e^±0.5 = [0.61, 1.65]: the cap binds on some tokens only
    keys = [*W, "sampler_logprobs"]
    _, grad, _ = run(
        "importance_sampling", rows, keys, LossConfig(truncated_importance_sampling=cap)
    )
    width = grad.shape[1]
    x = _tokens(rows, width)
    mismatch = (column(rows, "logprobs", width) - column(rows, "sampler_logprobs", width)).exp()
    counted = x["w"] != 0
    assert bool((mismatch[counted] > cap).any()) and bool((mismatch[counted] < cap).any())
    expected = -x["w"] * mismatch.clamp(max=cap) * x["adv"] * x["ratio"]
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_penalty_loss_mode_gradient(estimator: str, seed: int):
    # ℓ = −r·A + β·k with x = ref − lp (so dx/dlp = −1):
    #   k1 = lp − ref = −x               -> d k1 / d lp = 1
    #   k3 = e^x − x − 1                  -> d k3 / d lp = −e^x + 1 = 1 − e^{ref − lp}
    # so d ℓ / d lp = −A·r + β·(1 for k1, 1 − e^{ref − lp} for k3), times w.
    rows = seeded_rows(seed)
    beta = 0.3
    config = LossConfig(kl_penalty_coef=beta, kl_estimator=estimator)  # pyright: ignore[reportArgumentType]
    _, grad, _ = run("importance_sampling", rows, [*W, "ref_logprobs"], config)
    width = grad.shape[1]
    x = _tokens(rows, width)
    ref_minus_lp = column(rows, "ref_logprobs", width) - column(rows, "lp", width)
    dkl = torch.ones_like(ref_minus_lp) if estimator == "k1" else 1 - ref_minus_lp.exp()
    expected = x["w"] * (-x["adv"] * x["ratio"] + beta * dkl)
    # The two terms may cancel; both are O(1), so 1e-14 absolute bounds their fp64 rounding.
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)
