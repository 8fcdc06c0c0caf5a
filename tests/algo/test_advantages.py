import dataclasses
import math
import statistics

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from posttrain.algo.advantages import (
    AdvantageConfig,
    balance_advantages,
    compute_group_advantages,
    group_advantages,
    is_zero_variance,
    reduction_weights,
)

ESTIMATORS = ["grpo", "rloo", "dr_grpo", "maxrl", "reinforce_pp"]
PRESETS = ["token_mean", "sequence_mean", "constant", "sum"]
EPS = 1e-6

# Rewards in [-10, 10] as graders produce them: binary, a few levels, or arbitrary floats.
reward_lists = st.lists(
    st.one_of(
        st.sampled_from([0.0, 1.0]),
        st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.0]),
        st.floats(-10.0, 10.0, allow_nan=False, allow_infinity=False),
    ),
    min_size=1,
    max_size=16,
)


def naive_advantages(rewards: list[float], estimator: str, scale_rewards: bool) -> list[float]:
    """Per-completion loops over Python floats, independent of the torch implementation."""
    n = len(rewards)
    if n <= 1 or all(abs(r - rewards[0]) <= 1e-12 for r in rewards):
        return [0.0] * n
    mean = statistics.fmean(rewards)
    if estimator == "grpo":
        std = statistics.pstdev(rewards)
        return [(r - mean) / (std + EPS) if scale_rewards else r - mean for r in rewards]
    if estimator in ("dr_grpo", "reinforce_pp"):  # reinforce_pp's group part: centring only
        return [r - mean for r in rewards]
    if estimator == "rloo":
        out = []
        for i, r in enumerate(rewards):
            others = [rewards[j] for j in range(n) if j != i]
            out.append(r - sum(others) / len(others))
        return out
    if mean <= EPS:  # maxrl
        return [0.0] * n
    return [(r - mean) / (mean + EPS) for r in rewards]


# ---------------------------------------------------------------- hand-derived values


def test_grpo_hand_values():
    # [1,0,0,1]: mean 0.5, population std sqrt((4 * 0.25)/4) = 0.5,
    # A = ±0.5 / (0.5 + 1e-6) = ±0.999998000004
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64))
    a = 0.5 / 0.500001
    assert adv.tolist() == pytest.approx([a, -a, -a, a], rel=1e-12)
    assert a == pytest.approx(0.999998000004, rel=1e-12)
    # [2,4,9]: mean 5, deviations [-3,-1,4], pop var (9+1+16)/3 = 26/3, std = 2.9439202887759...
    std = math.sqrt(26 / 3)
    adv = group_advantages(torch.tensor([2.0, 4.0, 9.0], dtype=torch.float64))
    assert adv.tolist() == pytest.approx([d / (std + 1e-6) for d in (-3, -1, 4)], rel=1e-12)
    # scale_rewards=False: only centred -> [-3, -1, 4]
    adv = group_advantages(torch.tensor([2.0, 4.0, 9.0]), scale_rewards=False)
    assert adv.tolist() == [-3.0, -1.0, 4.0]


def test_dr_grpo_hand_values_never_scaled():
    # [1,0,0,1]: r - 0.5 = [0.5,-0.5,-0.5,0.5], whatever scale_rewards says.
    for scale in (True, False):
        adv = group_advantages(
            torch.tensor([1.0, 0.0, 0.0, 1.0]), estimator="dr_grpo", scale_rewards=scale
        )
        assert adv.tolist() == [0.5, -0.5, -0.5, 0.5]


def test_rloo_hand_values():
    # [1,0,0,1]: A_0 = 1 - mean(0,0,1) = 1 - 1/3 = 2/3, A_1 = 0 - mean(1,0,1) = -2/3;
    # same as (r - 0.5) * 4/3 = ±2/3.
    adv = group_advantages(
        torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64), estimator="rloo"
    )
    assert adv.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3], rel=1e-15)
    # [3,1]: A_0 = 3 - 1 = 2, A_1 = 1 - 3 = -2
    assert group_advantages(torch.tensor([3.0, 1.0]), estimator="rloo").tolist() == [2.0, -2.0]


def test_maxrl_hand_values():
    # [1,0,0,0]: mean 0.25, A = (1 - 0.25)/(0.25 + 1e-6) = 0.75/0.250001 = 2.99998800004...,
    # (0 - 0.25)/0.250001 = -0.99999600001...
    adv = group_advantages(
        torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64), estimator="maxrl"
    )
    assert adv.tolist() == pytest.approx([0.75 / 0.250001] + [-0.25 / 0.250001] * 3, rel=1e-12)
    # mean <= eps -> zeros: [-1, 1] has mean 0, [-2, 1] mean -0.5
    for rewards in ([-1.0, 1.0], [-2.0, 1.0]):
        assert group_advantages(torch.tensor(rewards), estimator="maxrl").tolist() == [0.0, 0.0]


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("rewards", [[0.7, 0.7, 0.7], [5.0], [1.0, 1.0 + 1e-13], [0.0, 0.0]])
def test_zero_variance_groups_get_zero_advantages(estimator, rewards):
    rewards_G = torch.tensor(rewards, dtype=torch.float64)
    assert is_zero_variance(rewards_G)
    adv = group_advantages(rewards_G, estimator=estimator)
    assert adv.tolist() == [0.0] * len(rewards)


def test_is_zero_variance_threshold():
    # 1e-13 apart is within ART's 1e-12 tolerance, 1e-9 apart is not.
    assert is_zero_variance(torch.tensor([1.0, 1.0 + 1e-13], dtype=torch.float64))
    assert not is_zero_variance(torch.tensor([1.0, 1.0 + 1e-9], dtype=torch.float64))
    assert not is_zero_variance(torch.tensor([0.0, 1.0]))
    assert is_zero_variance(torch.tensor([0.0, 1.0]), tol=1.0)
    assert is_zero_variance(torch.tensor([]))


def test_output_dtype_follows_rewards():
    assert group_advantages(torch.tensor([0.0, 1.0])).dtype == torch.float32
    assert group_advantages(torch.tensor([0.0, 1.0], dtype=torch.float64)).dtype == torch.float64
    assert group_advantages(torch.tensor([0, 1])).dtype == torch.get_default_dtype()
    assert group_advantages(torch.tensor([True, True])).tolist() == [0.0, 0.0]


# ---------------------------------------------------------------- naive reference, invariances


@settings(max_examples=50, deadline=None)
@given(rewards=reward_lists, estimator=st.sampled_from(ESTIMATORS), scale=st.booleans())
def test_matches_naive_loop_float64(rewards, estimator, scale):
    adv = group_advantages(
        torch.tensor(rewards, dtype=torch.float64), estimator=estimator, scale_rewards=scale
    )
    expected = naive_advantages(rewards, estimator, scale)
    # float64 rounding of the mean (~1e-15 for |r| <= 10) is amplified at most 1/eps = 1e6 times
    # by any denominator here (std + eps, mean + eps), so 1e-7 absolute bounds it with margin.
    for got, want in zip(adv.tolist(), expected, strict=True):
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-7)


@settings(max_examples=50, deadline=None)
@given(rewards=reward_lists, estimator=st.sampled_from(ESTIMATORS), scale=st.booleans())
def test_float32_is_float64_rounded(rewards, estimator, scale):
    # fp32 rewards are computed on in float64 and cast back, so the output is the float64
    # result on the fp32-rounded rewards, within one fp32 rounding (6e-8 relative; 1e-6 leaves
    # margin). Absolute slack as in the float64 test: the float64 rounding of the mean, times
    # at most 1/eps = 1e6, stays below 1e-7.
    rewards_G = torch.tensor(rewards, dtype=torch.float32)
    adv = group_advantages(rewards_G, estimator=estimator, scale_rewards=scale)
    assert adv.dtype == torch.float32
    expected = naive_advantages(rewards_G.tolist(), estimator, scale)
    for got, want in zip(adv.tolist(), expected, strict=True):
        assert math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-7)


@settings(max_examples=40, deadline=None)
@given(rewards=reward_lists)
def test_rloo_is_reward_minus_mean_of_others(rewards):
    assume(not is_zero_variance(torch.tensor(rewards, dtype=torch.float64)))
    adv = group_advantages(torch.tensor(rewards, dtype=torch.float64), estimator="rloo").tolist()
    for i, r in enumerate(rewards):
        others = rewards[:i] + rewards[i + 1 :]
        # both forms cancel ~1e-15 * |r|; no division by a small number
        assert math.isclose(adv[i], r - statistics.fmean(others), rel_tol=1e-9, abs_tol=1e-12)


@settings(max_examples=40, deadline=None)
@given(
    rewards=reward_lists,
    shift=st.floats(-5.0, 5.0),
    estimator=st.sampled_from(["grpo", "dr_grpo", "rloo"]),
)
def test_centred_estimators_are_shift_invariant(rewards, shift, estimator):
    r = torch.tensor(rewards, dtype=torch.float64)
    assume(not is_zero_variance(r) and not is_zero_variance(r + shift))
    a, b = (
        group_advantages(r, estimator=estimator),
        group_advantages(r + shift, estimator=estimator),
    )
    # shifting by |c| <= 5 perturbs the centred rewards by ~1e-15; / (std + eps) <= 1e6 amplification
    assert torch.allclose(a, b, rtol=1e-9, atol=1e-7)
    # centred: advantages sum to zero (up to float64 rounding)
    assert abs(a.sum().item()) <= 1e-6 * max(1.0, a.abs().sum().item())


# ---------------------------------------------------------------- validation


def test_group_advantages_rejects_bad_input():
    with pytest.raises(ValueError, match="rewards_G is empty"):
        group_advantages(torch.tensor([]))
    with pytest.raises(ValueError, match=r"rewards_G\[2\] is nan"):
        group_advantages(torch.tensor([0.0, 1.0, float("nan")]))
    with pytest.raises(ValueError, match=r"rewards_G\[0\] is inf"):
        group_advantages(torch.tensor([float("inf"), 1.0]))
    with pytest.raises(ValueError, match="rewards_G must be 1-D"):
        group_advantages(torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"estimator must be one of \['grpo', 'rloo', 'dr_grpo'"):
        group_advantages(torch.tensor([0.0, 1.0]), estimator="ppo")  # pyright: ignore[reportArgumentType]
    for eps in (0.0, -1e-6, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="eps"):
            group_advantages(torch.tensor([0.0, 1.0]), eps=eps)


# ---------------------------------------------------------------- advantage balance


def test_balance_hand_values():
    adv = torch.tensor([2.0, -2.0, 0.5, -1.0])
    # b = 0.25: negatives * 0.75 -> [2, -1.5, 0.5, -0.75]
    assert balance_advantages(adv, 0.25).tolist() == [2.0, -1.5, 0.5, -0.75]
    # b = -0.5: positives * 0.5 -> [1, -2, 0.25, -1]
    assert balance_advantages(adv, -0.5).tolist() == [1.0, -2.0, 0.25, -1.0]
    assert balance_advantages(adv, 0.0).tolist() == adv.tolist()
    assert balance_advantages(adv, 1.0).tolist() == [2.0, 0.0, 0.5, 0.0]
    assert balance_advantages(adv, -1.0).tolist() == [0.0, -2.0, 0.0, -1.0]
    # any shape, input untouched
    adv_BT = adv.reshape(2, 2)
    out = balance_advantages(adv_BT, 0.5)
    assert out.shape == (2, 2)
    assert out.tolist() == [[2.0, -1.0], [0.5, -0.5]]
    assert adv_BT.tolist() == [[2.0, -2.0], [0.5, -1.0]]


@pytest.mark.parametrize("balance", [1.5, -1.01, float("nan")])
def test_balance_rejects_out_of_range(balance):
    with pytest.raises(ValueError, match=r"balance must be in \[-1, 1\]"):
        balance_advantages(torch.tensor([1.0]), balance)


# ---------------------------------------------------------------- config and batch of groups


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"advantage_estimator": "ppo"}, "option advantage_estimator='ppo' is invalid"),
        ({"zero_variance_groups": "skip"}, "option zero_variance_groups='skip' is invalid"),
        ({"advantage_balance": 2.0}, r"option advantage_balance=2.0 is invalid: expected in \[-1"),
        ({"advantage_balance": float("nan")}, "option advantage_balance=nan is invalid"),
        ({"loss_reduction": "mean"}, "option loss_reduction='mean' is invalid"),
        ({"loss_reduction_constant": 0.0}, "option loss_reduction_constant=0.0 is invalid"),
        ({"loss_reduction": "constant"}, "loss_reduction_constant is needed by"),
    ],
)
def test_advantage_config_validation(kwargs, name):
    with pytest.raises(ValueError, match=name):
        AdvantageConfig(**kwargs)


def test_advantage_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        AdvantageConfig().advantage_balance = 1.0  # pyright: ignore[reportAttributeAccessIssue]


def test_compute_group_advantages_drops_zero_variance():
    groups = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.5], [3.0], [1.0, 0.0]]
    result = compute_group_advantages(groups, AdvantageConfig(advantage_estimator="dr_grpo"))
    assert result.kept == [True, False, False, True]
    assert result.zero_variance == [False, True, True, False]
    assert (result.num_groups, result.num_zero_variance_groups, result.num_dropped_groups) == (
        4,
        2,
        2,
    )
    # dr_grpo: r - mean -> [±0.5 ...], [0, 0], [0], [0.5, -0.5]
    assert [a.tolist() for a in result.advantages] == [
        [0.5, -0.5, -0.5, 0.5],
        [0.0, 0.0],
        [0.0],
        [0.5, -0.5],
    ]
    assert all(a.dtype == torch.float64 for a in result.advantages)

    kept_all = compute_group_advantages(groups, AdvantageConfig(zero_variance_groups="keep"))
    assert kept_all.kept == [True] * 4
    assert (kept_all.num_zero_variance_groups, kept_all.num_dropped_groups) == (2, 0)


def test_compute_group_advantages_applies_balance():
    # rloo [3, 1] -> [2, -2]; balance 0.5 halves the negative one -> [2, -1]
    config = AdvantageConfig(advantage_estimator="rloo", advantage_balance=0.5)
    assert compute_group_advantages([[3.0, 1.0]], config).advantages[0].tolist() == [2.0, -1.0]


def test_compute_group_advantages_names_the_bad_group():
    with pytest.raises(ValueError, match=r"groups_rewards\[1\]: rewards_G is empty"):
        compute_group_advantages([[1.0, 0.0], []], AdvantageConfig())
    with pytest.raises(ValueError, match=r"groups_rewards\[0\]: rewards_G\[2\] is nan"):
        compute_group_advantages([[1.0, 0.0, float("nan")]], AdvantageConfig())
    empty = compute_group_advantages([], AdvantageConfig())
    assert (empty.num_groups, empty.num_dropped_groups) == (0, 0)


# ------------------------------------------------ naive references for balance and groups

real_rewards = st.floats(-10.0, 10.0, allow_nan=False, allow_infinity=False)
# Groups as a step sees them: arbitrary real rewards, binary graders, and zero-variance groups
# (all equal, or a single completion).
group_lists = st.lists(
    st.one_of(
        st.lists(real_rewards, min_size=1, max_size=8),
        st.lists(st.sampled_from([0.0, 1.0]), min_size=2, max_size=8),
        st.builds(lambda r, n: [r] * n, real_rewards, st.integers(1, 8)),
    ),
    max_size=6,
)
advantage_configs = st.builds(
    AdvantageConfig,
    advantage_estimator=st.sampled_from(ESTIMATORS),
    scale_rewards=st.booleans(),
    zero_variance_groups=st.sampled_from(["drop", "keep"]),
    advantage_balance=st.one_of(st.just(0.0), st.floats(-1.0, 1.0)),
)


def naive_balance(adv: list[float], balance: float) -> list[float]:
    """ART's advantage_balance, one completion at a time."""
    out = []
    for a in adv:
        if balance > 0 and a < 0:
            a = a * (1.0 - balance)
        elif balance < 0 and a > 0:
            a = a * (1.0 + balance)
        out.append(a)
    return out


def naive_group_result(
    groups: list[list[float]], config: AdvantageConfig
) -> tuple[list[list[float]], list[bool], list[bool]]:
    """(advantages, kept, zero_variance) of every group, by loops over Python floats."""
    advantages, kept, zero_variance = [], [], []
    for rewards in groups:
        flat = len(rewards) <= 1 or all(abs(r - rewards[0]) <= 1e-12 for r in rewards)
        adv = naive_advantages(rewards, config.advantage_estimator, config.scale_rewards)
        advantages.append(naive_balance(adv, config.advantage_balance))
        zero_variance.append(flat)
        kept.append(not flat or config.zero_variance_groups == "keep")
    return advantages, kept, zero_variance


@settings(max_examples=50, deadline=None)
@given(
    # exact in fp32, so the fp32 and fp64 runs start from the same values
    adv=st.lists(st.floats(-100.0, 100.0, width=32), min_size=1, max_size=16),
    balance=st.one_of(st.sampled_from([-1.0, 0.0, 1.0]), st.floats(-1.0, 1.0)),
)
def test_balance_matches_naive_loop(adv, balance):
    expected = naive_balance(adv, balance)
    # float64: one multiplication by the same double (1 ∓ b) in both: bit-identical.
    assert balance_advantages(torch.tensor(adv, dtype=torch.float64), balance).tolist() == expected
    # float32: the product rounds once (6e-8 relative), so 1e-6 relative; the absolute 1e-37
    # covers products below fp32's normal range (1.2e-38), which lose relative precision.
    got32 = balance_advantages(torch.tensor(adv, dtype=torch.float32), balance).tolist()
    for got, want in zip(got32, expected, strict=True):
        assert math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-37)


@settings(max_examples=60, deadline=None)
@given(groups=group_lists, config=advantage_configs)
def test_compute_group_advantages_matches_naive_loop(groups, config):
    result = compute_group_advantages(groups, config)
    advantages, kept, zero_variance = naive_group_result(groups, config)
    assert (result.kept, result.zero_variance) == (kept, zero_variance)
    assert result.num_dropped_groups == sum(not k for k in kept)
    assert result.num_zero_variance_groups == sum(zero_variance)
    for got_G, want_G in zip(result.advantages, advantages, strict=True):
        assert got_G.dtype == torch.float64
        # as test_matches_naive_loop_float64; balancing multiplies by <= 1, amplifying nothing
        for got, want in zip(got_G.tolist(), want_G, strict=True):
            assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-7)


@settings(max_examples=50, deadline=None)
@given(groups=group_lists, config=advantage_configs, data=st.data())
def test_any_split_into_batches_gives_the_same_advantages(groups, config, data):
    # Advantages are per group: computing them batch by batch, for any split of the list of
    # groups (any sizes, any order of batches), gives bit-identical results to all at once.
    labels = data.draw(st.lists(st.integers(0, 3), min_size=len(groups), max_size=len(groups)))
    whole = compute_group_advantages(groups, config)
    advantages: list = [None] * len(groups)
    kept: list = [None] * len(groups)
    zero_variance: list = [None] * len(groups)
    for label in sorted(set(labels), reverse=True):
        index = [i for i, x in enumerate(labels) if x == label]
        part = compute_group_advantages([groups[i] for i in index], config)
        for j, i in enumerate(index):
            advantages[i], kept[i] = part.advantages[j], part.kept[j]
            zero_variance[i] = part.zero_variance[j]
    assert (kept, zero_variance) == (whole.kept, whole.zero_variance)
    for got, want in zip(advantages, whole.advantages, strict=True):
        assert torch.equal(got, want)


# ---------------------------------------------------------------- reduction weights


def test_reduction_hand_values():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    # token_mean: 4 tokens -> 1/4 each
    assert reduction_weights(mask, "token_mean").tolist() == [[0.25] * 3 + [0.0], [0.25, 0, 0, 0]]
    # sequence_mean: B = 2; row 0 has 3 tokens -> 1/(2*3) = 1/6, row 1 has 1 -> 1/(2*1) = 1/2
    w = reduction_weights(mask, "sequence_mean")
    expected = torch.tensor([[1 / 6] * 3 + [0.0], [0.5, 0, 0, 0]])
    torch.testing.assert_close(w, expected, rtol=1e-7, atol=0.0)  # one fp32 rounding of 1/6
    # constant B * max_len = 2 * 4 = 8 -> 1/8
    assert reduction_weights(mask, "constant", constant=8).tolist() == [
        [0.125] * 3 + [0.0],
        [0.125, 0, 0, 0],
    ]
    assert reduction_weights(mask, "sum").tolist() == mask.float().tolist()
    assert reduction_weights(mask, "sum").dtype == torch.float32
    assert reduction_weights(mask.double(), "token_mean").dtype == torch.float64


def test_sequence_mean_ignores_empty_rows():
    # [[1,1,0],[0,0,0]]: one non-empty sequence (B = 1) with 2 tokens -> 1/2 each; row 1 -> 0
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert reduction_weights(mask, "sequence_mean").tolist() == [[0.5, 0.5, 0.0], [0.0] * 3]
    # padding rows never change the other rows' weights
    padded = torch.cat([mask, torch.zeros(3, 3)])
    assert torch.equal(
        reduction_weights(padded, "sequence_mean")[:2], reduction_weights(mask, "sequence_mean")
    )
    assert reduction_weights(torch.zeros(2, 3), "sequence_mean").tolist() == [[0.0] * 3] * 2
    assert reduction_weights(torch.zeros(2, 3), "token_mean").tolist() == [[0.0] * 3] * 2


def test_local_normalisers_give_mean_of_means_bias():
    # Why global counts matter: rows of 3 and 1 tokens with x = 1 and 0 per token.
    # Whole-batch token mean = 3/4. Two parts each normalised locally: 3/3 + 0/1 = 1 != 3/4.
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    x = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    local = sum(
        (reduction_weights(mask[i : i + 1], "token_mean") * x[i : i + 1]).sum() for i in range(2)
    )
    glob = sum(
        (reduction_weights(mask[i : i + 1], "token_mean", total_tokens=4) * x[i : i + 1]).sum()
        for i in range(2)
    )
    assert (float(local), float(glob)) == (1.0, 0.75)


@st.composite
def batches(draw):
    """A [B, T] mask of left-aligned variable lengths (some rows empty), values x, a row partition."""
    b = draw(st.integers(1, 8))
    t = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(0, t), min_size=b, max_size=b))
    assume(sum(lengths) > 0)
    mask = torch.tensor(
        [[1.0 if j < n else 0.0 for j in range(t)] for n in lengths], dtype=torch.float64
    )
    values = draw(st.lists(st.floats(-1.0, 1.0), min_size=b * t, max_size=b * t))
    x = torch.tensor(values, dtype=torch.float64).reshape(b, t)
    parts = draw(st.lists(st.integers(0, 3), min_size=b, max_size=b))
    return mask, x, parts


@settings(max_examples=50, deadline=None)
@given(batch=batches(), preset=st.sampled_from(PRESETS))
def test_partition_invariance(batch, preset):
    mask, x, parts = batch
    glob = {}
    if preset == "token_mean":
        glob["total_tokens"] = float(mask.sum())
    elif preset == "sequence_mean":
        glob["num_sequences"] = int((mask.sum(dim=1) > 0).sum())
    elif preset == "constant":
        glob["constant"] = float(mask.numel())  # Dr. GRPO's B * max_len
    whole = (reduction_weights(mask, preset, **glob) * x).sum().item()
    split = 0.0
    for p in set(parts):
        rows = [i for i, q in enumerate(parts) if q == p]
        split += (reduction_weights(mask[rows], preset, **glob) * x[rows]).sum().item()
    # float64 sums of <= 48 terms of magnitude <= 1: reordering error ~1e-15
    assert math.isclose(split, whole, rel_tol=1e-12, abs_tol=1e-12)


@settings(max_examples=50, deadline=None)
@given(batch=batches())
def test_weighted_sums_are_the_named_means(batch):
    mask, x, _ = batch
    rows = mask.tolist()
    vals = x.tolist()
    # token mean: plain loop over masked tokens
    tokens = [
        v for mr, vr in zip(rows, vals, strict=True) for m, v in zip(mr, vr, strict=True) if m
    ]
    got = (reduction_weights(mask, "token_mean") * x).sum().item()
    assert math.isclose(got, sum(tokens) / len(tokens), rel_tol=1e-12, abs_tol=1e-12)
    # sequence mean: mean over non-empty sequences of each sequence's token mean
    seq_means = []
    for mr, vr in zip(rows, vals, strict=True):
        seq = [v for m, v in zip(mr, vr, strict=True) if m]
        if seq:
            seq_means.append(sum(seq) / len(seq))
    got = (reduction_weights(mask, "sequence_mean") * x).sum().item()
    assert math.isclose(got, statistics.fmean(seq_means), rel_tol=1e-12, abs_tol=1e-12)
    # constant: masked sum / constant
    got = (reduction_weights(mask, "constant", constant=7.0) * x).sum().item()
    assert math.isclose(got, sum(tokens) / 7.0, rel_tol=1e-12, abs_tol=1e-12)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((torch.ones(3), "sum"), {}, "mask_BT must be 2-D"),
        ((-torch.ones(2, 2), "sum"), {}, "mask_BT must be finite and >= 0"),
        ((torch.full((2, 2), float("nan")), "sum"), {}, "mask_BT"),
        ((torch.ones(2, 2), "mean"), {}, r"preset must be one of \['token_mean'"),
        ((torch.ones(2, 2), "constant"), {}, "constant must be a finite number > 0"),
        ((torch.ones(2, 2), "constant"), {"constant": 0.0}, "constant must be"),
        ((torch.ones(2, 2), "token_mean"), {"constant": 8.0}, "constant applies to preset"),
        ((torch.ones(2, 2), "sequence_mean"), {"total_tokens": 4.0}, "total_tokens applies"),
        ((torch.ones(2, 2), "token_mean"), {"num_sequences": 2}, "num_sequences applies"),
        ((torch.ones(2, 2), "token_mean"), {"total_tokens": 0.0}, "total_tokens must be"),
        ((torch.ones(2, 2), "token_mean"), {"total_tokens": 3.0}, "total_tokens=3.0 is less"),
        ((torch.ones(2, 2), "sequence_mean"), {"num_sequences": 1}, "num_sequences=1 is less"),
        (
            (torch.ones(2, 2), "sequence_mean"),
            {"num_sequences": 2.5},
            "num_sequences must be an int > 0, got 2.5",
        ),
        (
            (torch.ones(2, 2), "sequence_mean"),
            {"num_sequences": float("nan")},
            "num_sequences must be an int > 0, got nan",
        ),
        ((torch.ones(2, 2), "sequence_mean"), {"num_sequences": 0}, "num_sequences must be"),
    ],
)
def test_reduction_weights_rejects_bad_input(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        reduction_weights(*args, **kwargs)
