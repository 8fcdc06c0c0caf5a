import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.algo.gae import gae, token_rewards, whiten_advantages

F64 = torch.float64
# float64 throughout: a backward recursion over <= 12 tokens of values in [-10, 10] stays
# within ~1e-13 of the exact result, so 1e-10 relative + absolute is far above rounding.
REL = ABS = 1e-10


def naive_gae(
    values: list[float], rewards: list[float], mask: list[int], gamma: float, lam: float
) -> tuple[list[float], list[float]]:
    """A_t = Σ_l (γλ)^l δ_{t+l} as a double loop over the row's valid tokens, from the formula."""
    idx = [t for t, m in enumerate(mask) if m]
    n = len(idx)
    deltas = []
    for k in range(n):
        next_value = values[idx[k + 1]] if k + 1 < n else 0.0
        deltas.append(rewards[idx[k]] + gamma * next_value - values[idx[k]])
    adv, ret = [0.0] * len(mask), [0.0] * len(mask)
    for k in range(n):
        a = math.fsum((gamma * lam) ** j * deltas[k + j] for j in range(n - k))
        adv[idx[k]] = a
        ret[idx[k]] = a + values[idx[k]]
    return adv, ret


values = st.floats(-10.0, 10.0, allow_nan=False, allow_infinity=False)
unit = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.0, 1.0))


@st.composite
def batches(draw: st.DrawFn, contiguous: bool = False):
    """(values, rewards, mask) lists of B rows of T tokens; masks of any lengths, empty too."""
    B = draw(st.integers(1, 4))
    T = draw(st.integers(0, 12))
    rows_v = [draw(st.lists(values, min_size=T, max_size=T)) for _ in range(B)]
    rows_r = [draw(st.lists(values, min_size=T, max_size=T)) for _ in range(B)]
    masks = []
    for _ in range(B):
        if contiguous or draw(st.booleans()):
            start = draw(st.integers(0, T))
            end = draw(st.integers(start, T))
            masks.append([int(start <= t < end) for t in range(T)])
        else:
            masks.append(draw(st.lists(st.sampled_from([0, 1]), min_size=T, max_size=T)))
    return rows_v, rows_r, masks


def tensors(rows_v, rows_r, masks):
    T = len(masks[0])
    shape = (len(masks), T)
    return (
        torch.tensor(rows_v, dtype=F64).reshape(shape),
        torch.tensor(rows_r, dtype=F64).reshape(shape),
        torch.tensor(masks, dtype=torch.bool).reshape(shape),
    )


# ---------------------------------------------------------------- hand-derived values

# γ = 0.9, λ = 0.8, γλ = 0.72; V = [1, 2, 0, 1, 2], r = [0, 0, 0, 0, 1]
# δ_4 = 1 + 0.9·0 − 2 = −1          (V after the last token = 0)
# δ_3 = 0 + 0.9·2 − 1 = 0.8
# δ_2 = 0 + 0.9·1 − 0 = 0.9
# δ_1 = 0 + 0.9·0 − 2 = −2
# δ_0 = 0 + 0.9·2 − 1 = 0.8
# A_4 = −1
# A_3 = 0.8 + 0.72·(−1)       = 0.08
# A_2 = 0.9 + 0.72·0.08       = 0.9576
# A_1 = −2  + 0.72·0.9576     = −2 + 0.689472 = −1.310528
# A_0 = 0.8 + 0.72·(−1.310528) = 0.8 − 0.94358016 = −0.14358016
# R = A + V = [0.85641984, 0.689472, 0.9576, 1.08, 1.0]
HAND_V = [1.0, 2.0, 0.0, 1.0, 2.0]
HAND_R = [0.0, 0.0, 0.0, 0.0, 1.0]
HAND_A = [-0.14358016, -1.310528, 0.9576, 0.08, -1.0]
HAND_RET = [0.85641984, 0.689472, 0.9576, 1.08, 1.0]


def test_gae_hand_values():
    adv, ret = gae(
        torch.tensor([HAND_V], dtype=F64),
        torch.tensor([HAND_R], dtype=F64),
        torch.ones(1, 5, dtype=torch.bool),
        gamma=0.9,
        lam=0.8,
    )
    assert adv[0].tolist() == pytest.approx(HAND_A, rel=1e-12)
    assert ret[0].tolist() == pytest.approx(HAND_RET, rel=1e-12)


def test_gae_hand_values_inside_prompt_and_padding():
    # Row 0: one prompt token, the 5 hand tokens, one padding token; values and rewards off the
    # mask are nan and must never be read. Row 1: 2 tokens, V = [1, 1], r = [0, 3]:
    # δ_1 = 3 − 1 = 2, δ_0 = 0 + 0.9·1 − 1 = −0.1, A_1 = 2, A_0 = −0.1 + 0.72·2 = 1.34.
    nan = math.nan
    values_BT = torch.tensor([[nan, *HAND_V, nan], [1.0, 1.0, nan, nan, nan, nan, nan]], dtype=F64)
    rewards_BT = torch.tensor([[nan, *HAND_R, nan], [0.0, 3.0, nan, nan, nan, nan, nan]], dtype=F64)
    mask_BT = torch.tensor([[0, 1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0, 0]])
    adv, ret = gae(values_BT, rewards_BT, mask_BT, gamma=0.9, lam=0.8)
    assert adv[0].tolist() == pytest.approx([0.0, *HAND_A, 0.0], rel=1e-12)
    assert ret[0].tolist() == pytest.approx([0.0, *HAND_RET, 0.0], rel=1e-12)
    assert adv[1].tolist() == pytest.approx([1.34, 2.0, 0, 0, 0, 0, 0], rel=1e-12)
    assert ret[1].tolist() == pytest.approx([2.34, 3.0, 0, 0, 0, 0, 0], rel=1e-12)


def test_gae_skips_masked_tokens_inside_a_row():
    # Mask [1, 0, 1]: the middle token (e.g. a tool's output) is skipped, not discounted.
    # V = [1, nan, 2], r = [0, nan, 1], γ = 0.5, λ = 1: δ_2 = 1 − 2 = −1,
    # δ_0 = 0 + 0.5·2 − 1 = 0, A_2 = −1, A_0 = 0 + 0.5·(−1) = −0.5.
    adv, _ = gae(
        torch.tensor([[1.0, math.nan, 2.0]], dtype=F64),
        torch.tensor([[0.0, math.nan, 1.0]], dtype=F64),
        torch.tensor([[1, 0, 1]]),
        gamma=0.5,
        lam=1.0,
    )
    assert adv.tolist() == [[-0.5, 0.0, -1.0]]


def test_gae_outputs_are_targets_without_gradient():
    values_BT = torch.tensor([HAND_V], dtype=F64, requires_grad=True)
    adv, ret = gae(values_BT, torch.zeros(1, 5, dtype=F64), torch.ones(1, 5), gamma=1.0, lam=1.0)
    assert not adv.requires_grad and not ret.requires_grad


def test_gae_rejects_bad_inputs():
    v = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="shape"):
        gae(v, torch.zeros(2, 4), torch.ones(2, 3), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="shape"):
        gae(torch.zeros(3), torch.zeros(3), torch.ones(3), gamma=1.0, lam=1.0)
    for gamma, lam in [(1.1, 0.5), (0.9, -0.1), (math.nan, 0.5)]:
        with pytest.raises(ValueError, match="in \\[0, 1\\]"):
            gae(v, v, torch.ones(2, 3), gamma=gamma, lam=lam)


# ---------------------------------------------------------------- reference and properties


@settings(max_examples=200, deadline=None)
@given(batches(), unit, unit)
def test_gae_matches_naive_double_loop(batch, gamma, lam):
    values_BT, rewards_BT, mask_BT = tensors(*batch)
    adv, ret = gae(values_BT, rewards_BT, mask_BT, gamma=gamma, lam=lam)
    for b, (v, r, m) in enumerate(zip(*batch, strict=True)):
        want_adv, want_ret = naive_gae(v, r, m, gamma, lam)
        assert adv[b].tolist() == pytest.approx(want_adv, rel=REL, abs=ABS)
        assert ret[b].tolist() == pytest.approx(want_ret, rel=REL, abs=ABS)


@settings(max_examples=100, deadline=None)
@given(batches(contiguous=True))
def test_gamma_lambda_one_is_future_reward_sum_minus_value(batch):
    # γ = λ = 1: A_t = Σ_{s≥t} r_s − V_t (the V terms of the δ telescope).
    values_BT, rewards_BT, mask_BT = tensors(*batch)
    adv, _ = gae(values_BT, rewards_BT, mask_BT, gamma=1.0, lam=1.0)
    future_BT = torch.where(mask_BT, rewards_BT, 0.0).flip(1).cumsum(1).flip(1)
    want_BT = torch.where(mask_BT, future_BT - values_BT, 0.0)
    torch.testing.assert_close(adv, want_BT, rtol=REL, atol=ABS)


@settings(max_examples=100, deadline=None)
@given(batches(), unit)
def test_lambda_one_returns_are_discounted_reward_sums(batch, gamma):
    # λ = 1: R_t = Σ_l γ^l r_{t+l}, whatever the critic says.
    values_BT, rewards_BT, mask_BT = tensors(*batch)
    _, ret = gae(values_BT, rewards_BT, mask_BT, gamma=gamma, lam=1.0)
    _, ret_zero_critic = gae(torch.zeros_like(values_BT), rewards_BT, mask_BT, gamma=gamma, lam=1.0)
    torch.testing.assert_close(ret, ret_zero_critic, rtol=REL, atol=ABS)


@settings(max_examples=100, deadline=None)
@given(batches(contiguous=True), unit)
def test_lambda_zero_is_one_step_td_error(batch, gamma):
    # λ = 0: A_t = δ_t = r_t + γ V_{t+1} − V_t, V_{t+1} = 0 after the span.
    values_BT, rewards_BT, mask_BT = tensors(*batch)
    adv, _ = gae(values_BT, rewards_BT, mask_BT, gamma=gamma, lam=0.0)
    next_BT = torch.zeros_like(values_BT)
    next_BT[:, :-1] = torch.where(mask_BT[:, 1:], values_BT[:, 1:], 0.0)
    want_BT = torch.where(mask_BT, rewards_BT + gamma * next_BT - values_BT, 0.0)
    torch.testing.assert_close(adv, want_BT, rtol=REL, atol=ABS)


@settings(max_examples=50, deadline=None)
@given(batches(), unit, unit, st.integers(1, 4))
def test_gae_ignores_padding_columns_and_off_mask_values(batch, gamma, lam, pad):
    values_BT, rewards_BT, mask_BT = tensors(*batch)
    adv, ret = gae(values_BT, rewards_BT, mask_BT, gamma=gamma, lam=lam)
    B = values_BT.shape[0]
    garbage = torch.full((B, pad), 1e6, dtype=F64)
    nan_off = torch.where(mask_BT, values_BT, math.nan)
    adv_p, ret_p = gae(
        torch.cat([nan_off, garbage], 1),
        torch.cat([rewards_BT, garbage], 1),
        torch.cat([mask_BT, torch.zeros(B, pad, dtype=torch.bool)], 1),
        gamma=gamma,
        lam=lam,
    )
    # Same operations on the same numbers: bit-identical.
    assert torch.equal(adv_p[:, : adv.shape[1]], adv)
    assert torch.equal(ret_p[:, : ret.shape[1]], ret)
    assert not adv_p[:, adv.shape[1] :].any()


# ---------------------------------------------------------------- whitening


def test_whiten_advantages_hand_values():
    # Valid [1, 2, 3]: μ = 2, population σ = sqrt((1 + 0 + 1)/3) = sqrt(2/3) = 0.81649658...;
    # the padding's 100 is not counted and comes back 0.
    adv_BT = torch.tensor([[1.0, 2.0], [3.0, 100.0]], dtype=F64)
    out = whiten_advantages(adv_BT, torch.tensor([[1, 1], [1, 0]]))
    s = math.sqrt(2 / 3) + 1e-8
    assert out.flatten().tolist() == pytest.approx([-1 / s, 0.0, 1 / s, 0.0], rel=1e-12)


@settings(max_examples=100, deadline=None)
@given(batches())
def test_whiten_advantages_zero_mean_unit_std_on_valid_tokens(batch):
    values_BT, _, mask_BT = tensors(*batch)
    out = whiten_advantages(values_BT, mask_BT)
    assert not out[~mask_BT].any()
    valid_N = values_BT[mask_BT]
    if valid_N.numel() > 0:
        assert float(out[mask_BT].mean()) == pytest.approx(0.0, abs=1e-9)
    sigma = float(valid_N.std(correction=0)) if valid_N.numel() > 0 else 0.0
    if sigma > 1e-3:  # the +1e-8 in σ + 1e-8 moves the std by at most 1e-5 relative
        assert float(out[mask_BT].std(correction=0)) == pytest.approx(1.0, rel=1e-5)


# ---------------------------------------------------------------- token rewards


def test_token_rewards_on_last_valid_token():
    # Row 0 has prompt and padding: its last valid token is index 2. Row 1 is full: index 3.
    mask_BT = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]])
    out = token_rewards(torch.tensor([2.0, -1.0], dtype=F64), mask_BT)
    assert out.tolist() == [[0.0, 0.0, 2.0, 0.0], [0.0, 0.0, 0.0, -1.0]]


def test_token_rewards_with_kl_penalty():
    # β = 0.1, kl = 0.5 on every token: −0.05 on valid tokens, the reward added on the last;
    # the padding's kl (nan) is never read.
    mask_BT = torch.tensor([[0, 1, 1, 0]])
    kl_BT = torch.tensor([[0.5, 0.5, 0.5, math.nan]], dtype=F64)
    out = token_rewards(torch.tensor([2.0], dtype=F64), mask_BT, kl_BT=kl_BT, kl_coef=0.1)
    assert out[0].tolist() == pytest.approx([0.0, -0.05, 1.95, 0.0], rel=1e-12)


def test_token_rewards_rejects_a_row_without_tokens_and_bad_shapes():
    with pytest.raises(ValueError, match="row 1"):
        token_rewards(torch.tensor([1.0, 1.0]), torch.tensor([[1, 0], [0, 0]]))
    with pytest.raises(ValueError, match="same B"):
        token_rewards(torch.tensor([1.0]), torch.tensor([[1, 0], [1, 1]]))


@settings(max_examples=50, deadline=None)
@given(batches(contiguous=True))
def test_sequence_reward_with_gamma_lambda_one_gives_reward_minus_value(batch):
    # End to end: a sequence reward on the last token, γ = λ = 1: A_t = r_b − V_t.
    values_BT, _, mask_BT = tensors(*batch)
    keep_B = mask_BT.any(1)
    values_BT, mask_BT = values_BT[keep_B], mask_BT[keep_B]
    if values_BT.shape[0] == 0:
        return
    rewards_B = torch.arange(values_BT.shape[0], dtype=F64) - 0.5
    rewards_BT = token_rewards(rewards_B, mask_BT)
    adv, _ = gae(values_BT, rewards_BT, mask_BT, gamma=1.0, lam=1.0)
    want_BT = torch.where(mask_BT, rewards_B[:, None] - values_BT, 0.0)
    torch.testing.assert_close(adv, want_BT, rtol=REL, atol=ABS)
