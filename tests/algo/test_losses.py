"""Tests of algo.losses: hand-derived values (a), invariance to the micro-batch split and to
padding (d), metrics, and bad input. The naive reference (b) is in test_loss_reference.py, the
closed-form gradients (c) in test_loss_gradients.py.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from loss_helpers import (
    LN2,
    NAN,
    POLICY,
    SPEC_THRESHOLDS,
    Row,
    W,
    make_batch,
    row_lists,
    run,
    seeded_rows,
)

from posttrain.algo.loss_config import PER_TOKEN_INPUTS
from posttrain.algo.loss_metrics import summarize
from posttrain.algo.losses import (
    DEFAULT_THRESHOLDS,
    LOSSES,
    REQUIRED_INPUTS,
    LossBatch,
    LossConfig,
    check_config,
    check_inputs,
    get_loss,
    resolved_thresholds,
)

# ------------------------------------------------------------------ (a) hand-derived values


def test_cross_entropy_hand_values():
    # −Σ w·lp = −(1·ln 0.5) − (−2·ln 0.25) = ln 2 − 4 ln 2 = −3 ln 2; negative weights allowed.
    row = {"lp": [math.log(0.5), math.log(0.25)], "weights": [1.0, -2.0]}
    loss, grad, _ = run("cross_entropy", [row], ["weights"])
    assert loss == pytest.approx(-3 * LN2, rel=1e-12)
    assert grad.tolist() == [[-1.0, 2.0]]  # d/dlp = −w


def test_importance_sampling_hand_values():
    # r = [1.5/1, 0.5/0.25] = [1.5, 2]; −Σ r·A = −(1.5·2 + 2·(−1)) = −1.
    row = {"lp": [math.log(1.5), math.log(0.5)], "logprobs": [0.0, math.log(0.25)]}
    row["advantages"] = [2.0, -1.0]
    loss, _, _ = run("importance_sampling", [row], ["logprobs", "advantages"])
    assert loss == pytest.approx(-1.0, rel=1e-12)


@pytest.mark.parametrize(
    ("ratio", "adv", "expected"),
    [
        (1.5, 2.0, -2.4),  # min(1.5·2, 1.2·2) = 2.4 -> −2.4
        (1.5, -1.0, 1.5),  # min(−1.5, −1.2) = −1.5 -> 1.5 (no clip on the pessimistic side)
        (0.5, -1.0, 0.8),  # min(−0.5, 0.8·(−1)) = −0.8 -> 0.8
        (0.5, 1.0, -0.5),  # min(0.5, 0.8) = 0.5 -> −0.5
        (1.1, 1.0, -1.1),  # inside [0.8, 1.2]: −r·A
    ],
)
def test_ppo_hand_values(ratio: float, adv: float, expected: float):
    row = {"lp": [math.log(ratio)], "logprobs": [0.0], "advantages": [adv]}
    loss, _, out = run("ppo", [row], ["logprobs", "advantages"])
    assert loss == pytest.approx(expected, rel=1e-12)
    assert out.per_token["ratio"][0, 0].item() == pytest.approx(ratio, rel=1e-12)
    # clipped only when the clip term wins the min: rows 1 and 3
    assert out.per_token["clipped"][0, 0].item() == float(expected in (-2.4, 0.8))


def test_cispo_hand_values():
    # r = 0.5/0.1 = 5, clipped to 4 (hi); ℓ = −4·A·lp = −4·1·ln 0.5 = 4 ln 2; d/dlp = −4.
    row = {"lp": [math.log(0.5)], "logprobs": [math.log(0.1)], "advantages": [1.0]}
    loss, grad, out = run("cispo", [row], ["logprobs", "advantages"])
    assert loss == pytest.approx(4 * LN2, rel=1e-12)
    assert grad.item() == pytest.approx(-4.0, rel=1e-12)
    assert out.per_token["clipped"].item() == 1.0


def test_dro_hand_values():
    # β = 0.5, lp − q = ln 0.5 − ln 0.25 = ln 2, A = 1:
    # ℓ = −(lp·A − ½β(lp − q)²) = −(−ln 2 − 0.25·ln²2) = ln 2 + 0.25·ln²2 ≈ 0.81325
    row = {"lp": [math.log(0.5)], "logprobs": [math.log(0.25)], "advantages": [1.0]}
    loss, grad, _ = run("dro", [row], ["logprobs", "advantages"], LossConfig(dro_beta=0.5))
    assert loss == pytest.approx(LN2 + 0.25 * LN2**2, rel=1e-12)
    assert grad.item() == pytest.approx(-(1.0 - 0.5 * LN2), rel=1e-12)  # −(A − β(lp − q))


def test_gspo_hand_values():
    # Δ = [ln 2, −ln 2] -> mean 0 -> s = 1: no clip, ℓ = −A per token, loss −2;
    # token-level ppo on the same row would clip r = 2 to 1.2 and give −(1.2 + 0.5) = −1.7.
    keys = ["logprobs", "advantages"]
    row = {"lp": [math.log(0.5)] * 2, "logprobs": [math.log(0.25), 0.0], "advantages": [1.0, 1.0]}
    assert run("gspo", [row], keys)[0] == pytest.approx(-2.0, rel=1e-12)
    assert run("ppo", [row], keys)[0] == pytest.approx(-1.7, rel=1e-12)
    # Δ = [ln 2, ln 2] -> s = 2, clipped to 1 + 4e-4 per token: loss −2·1.0004 = −2.0008.
    row["logprobs"] = [math.log(0.25)] * 2
    loss, _, out = run("gspo", [row], keys)
    assert loss == pytest.approx(-2.0008, rel=1e-12)
    assert out.per_token["ratio"][0].tolist() == pytest.approx([2.0, 2.0], rel=1e-12)


@pytest.mark.parametrize(
    ("level", "expected"),
    [
        ("token", -3.0),  # r = [2, 1]: −(2 + 1)
        ("sequence", -2 * math.sqrt(2)),  # s = exp((ln 2 + 0)/2) = √2 on both tokens
        ("average", -(3 + 2 * math.sqrt(2)) / 2),  # (2 + √2)/2 + (1 + √2)/2
        ("geometric_average", -(2**0.75 + 2**0.25)),  # √(2·√2) + √(1·√2)
    ],
)
def test_importance_sampling_levels_hand_values(level: str, expected: float):
    row = {"lp": [math.log(0.5)] * 2, "logprobs": [math.log(0.25), math.log(0.5)]}
    row["advantages"] = [1.0, 1.0]
    config = LossConfig.from_mapping({"importance_sampling_level": level})
    loss, *_ = run("importance_sampling", [row], ["logprobs", "advantages"], config)
    assert loss == pytest.approx(expected, rel=1e-12)


def test_mask_prob_ratio_hand_values():
    # r = [1.5, 1.1], A = 1: 1.5 is outside (0.8, 1.2) and dropped; loss = −1.1, grad [0, −1.1].
    row = {"lp": [math.log(1.5), math.log(1.1)], "logprobs": [0.0, 0.0], "advantages": [1.0, 1.0]}
    loss, grad, out = run(
        "ppo", [row], ["logprobs", "advantages"], LossConfig(mask_prob_ratio=True)
    )
    assert loss == pytest.approx(-1.1, rel=1e-12)
    assert grad[0].tolist() == pytest.approx([0.0, -1.1], rel=1e-12)
    assert out.per_token["clipped"].tolist() == [[1.0, 0.0]]


def test_kimi_tau_hand_values():
    # Δ = ln 2, τ = 0.5: A = 1 − 0.5·ln 2 ≈ 0.65343; r = 2 -> ℓ = −2·0.65343 ≈ −1.30685.
    row = {"lp": [math.log(0.5)], "logprobs": [math.log(0.25)], "advantages": [1.0]}
    config = LossConfig(kimi_k2_tau=0.5)
    loss, *_ = run("importance_sampling", [row], ["logprobs", "advantages"], config)
    assert loss == pytest.approx(-2 * (1 - 0.5 * LN2), rel=1e-12)


@pytest.mark.parametrize(("cap", "expected"), [(1.5, -1.5), (3.0, -2.0)])
def test_truncated_importance_sampling_hand_values(cap: float, expected: float):
    # On-policy r = 1, A = 1; π_old/π_sampler = 0.5/0.25 = 2 -> weight min(2, U).
    row = {"lp": [math.log(0.5)], "logprobs": [math.log(0.5)], "advantages": [1.0]}
    row["sampler_logprobs"] = [math.log(0.25)]
    config = LossConfig(truncated_importance_sampling=cap)
    keys = ["logprobs", "advantages", "sampler_logprobs"]
    assert run("importance_sampling", [row], keys, config)[0] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        ("k1", 0.1 * LN2),  # k1 = lp − ref = ln 2; β·k1
        ("k3", 0.1 * (0.5 + LN2 - 1)),  # k3 = e^{−ln 2} − (−ln 2) − 1 ≈ 0.19315
    ],
)
def test_kl_loss_hand_values(estimator: str, expected: float):
    row = {"lp": [math.log(0.5)], "logprobs": [math.log(0.5)], "advantages": [0.0]}
    row["ref_logprobs"] = [math.log(0.25)]
    config = LossConfig(kl_penalty_coef=0.1, kl_estimator=estimator)  # pyright: ignore[reportArgumentType]
    keys = ["logprobs", "advantages", "ref_logprobs"]
    loss, _, out = run("importance_sampling", [row], keys, config)
    assert loss == pytest.approx(expected, rel=1e-12)
    assert out.per_token["kl"].item() == pytest.approx(expected / 0.1, rel=1e-12)


def test_kl_advantage_shaping_hand_values():
    # k1 = [ln 2, 0], k̄ = ln 2 / 2, β = 1, A = 0: A' = [−ln 2/2, ln 2/2]; on-policy r = 1, so
    # the loss −ΣA' = 0 and the gradient is −A' = [ln 2/2, −ln 2/2].
    row = {"lp": [math.log(0.5)] * 2, "logprobs": [math.log(0.5)] * 2, "advantages": [0.0, 0.0]}
    row["ref_logprobs"] = [math.log(0.25), math.log(0.5)]
    config = LossConfig(kl_penalty_coef=1.0, kl_estimator="k1", kl_mode="advantage")
    keys = ["logprobs", "advantages", "ref_logprobs"]
    loss, grad, _ = run("importance_sampling", [row], keys, config)
    assert loss == pytest.approx(0.0, abs=1e-15)
    assert grad[0].tolist() == pytest.approx([LN2 / 2, -LN2 / 2], rel=1e-12)


def test_missing_logprobs_allowed_means_ratio_one():
    # q unknown on token 0 -> q := sg(lp), r = 1: ℓ = −A = −3; token 1 has r = 2: ℓ = −2.
    row = {"lp": [math.log(0.5)] * 2, "logprobs": [NAN, math.log(0.25)], "advantages": [3.0, 1.0]}
    config = LossConfig(allow_training_without_logprobs=True)
    loss, grad, _ = run("importance_sampling", [row], ["logprobs", "advantages"], config)
    assert loss == pytest.approx(-5.0, rel=1e-12)
    assert grad[0].tolist() == pytest.approx([-3.0, -2.0], rel=1e-12)


def test_gspo_sequence_ratio_mask_picks_the_mean_only():
    # Δ = [ln 2, 0], sequence_ratio_mask = [1, 0]: s = exp(ln 2) = 2 on both tokens, clipped to
    # 1.0004; both tokens still count (as in Tinker): loss = −2·1.0004 = −2.0008.
    row = {"lp": [math.log(0.5)] * 2, "logprobs": [math.log(0.25), math.log(0.5)]}
    row["advantages"], row["sequence_ratio_mask"] = [1.0, 1.0], [1.0, 0.0]
    keys = ["logprobs", "advantages", "sequence_ratio_mask"]
    assert run("gspo", [row], keys)[0] == pytest.approx(-2.0008, rel=1e-12)


def test_explicit_mask_gates_the_loss_and_the_sequence_mean():
    # mask = [1, 0]: s = exp(Δ_0) = 2 (token 1 left out of the mean), loss = −2·A_0 = −2.
    row = {"lp": [math.log(0.5)] * 2, "logprobs": [math.log(0.25), 0.0], "advantages": [1.0, 5.0]}
    row["mask"] = [1.0, 0.0]
    config = LossConfig(importance_sampling_level="sequence")
    keys = ["logprobs", "advantages", "mask"]
    assert run("importance_sampling", [row], keys, config)[0] == pytest.approx(-2.0, rel=1e-12)


# -------------------------------------------------------------------------- (d) invariance


INVARIANCE_CASES = [
    ("cross_entropy", LossConfig(), ["weights"]),
    ("importance_sampling", LossConfig(importance_sampling_level="geometric_average"), W),
    ("ppo", LossConfig(mask_prob_ratio=True, kimi_k2_tau=0.2), W),
    ("cispo", LossConfig(truncated_importance_sampling=1.1), [*W, "sampler_logprobs"]),
    ("dro", LossConfig(dro_beta=0.2), [*W, "mask"]),
    ("gspo", LossConfig(), [*W, "sequence_ratio_mask"]),
    ("ppo", LossConfig(kl_penalty_coef=0.5, kl_mode="advantage"), [*W, "ref_logprobs"]),
    ("ppo", LossConfig(kl_penalty_coef=0.5, kl_estimator="k1"), [*W, "ref_logprobs"]),
]


INVARIANCE_IDS = [f"{name}-{i}" for i, (name, *_) in enumerate(INVARIANCE_CASES)]


def _partition(labels: Sequence[int]) -> list[list[int]]:
    """Row indices grouped by label: one micro-batch per distinct label."""
    return [[i for i, x in enumerate(labels) if x == label] for label in sorted(set(labels))]


def _rows_of(batch: LossBatch, logp: torch.Tensor, index: list[int]) -> LossBatch:
    """The micro-batch of rows `index`, its logprobs a view of `logp` (gradients flow back)."""
    rows = torch.tensor(index)
    inputs = {key: value[rows] for key, value in batch.inputs.items()}
    return LossBatch(logp[rows], inputs, batch.pad_mask_BT[rows])


@pytest.mark.parametrize(("name", "config", "keys"), INVARIANCE_CASES, ids=INVARIANCE_IDS)
@settings(max_examples=20, deadline=None)
@given(rows=row_lists(max_rows=5), data=st.data())
def test_any_row_split_sums_to_the_whole_batch(
    name: str, config: LossConfig, keys: list[str], rows: list[Row], data: st.DataObject
):
    labels = data.draw(st.lists(st.integers(0, 3), min_size=len(rows), max_size=len(rows)))
    whole, whole_logp = make_batch(rows, keys)
    whole_loss = get_loss(name)(whole, config).loss
    whole_loss.backward()
    split, split_logp = make_batch(rows, keys)
    parts = [
        get_loss(name)(_rows_of(split, split_logp, rows), config).loss
        for rows in _partition(labels)
    ]
    split_loss = torch.stack(parts).sum()
    split_loss.backward()
    # fp64, the same terms summed in another order: ~1e-16 relative each.
    torch.testing.assert_close(split_loss, whole_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(split_logp.grad, whole_logp.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("name", "config", "keys"), INVARIANCE_CASES, ids=INVARIANCE_IDS)
def test_padding_contributes_nothing(name: str, config: LossConfig, keys: list[str]):
    # Extra padded columns whose inputs are all NaN change neither the loss nor the gradient.
    rows = seeded_rows(7)
    tight, tight_logp = make_batch(rows, keys)
    padded, padded_logp = make_batch(rows, keys, extra_pad=3, pad_fill=NAN)
    tight_loss, padded_loss = (
        get_loss(name)(tight, config).loss,
        get_loss(name)(padded, config).loss,
    )
    (tight_loss + padded_loss).backward()
    assert tight_logp.grad is not None and padded_logp.grad is not None
    torch.testing.assert_close(padded_loss, tight_loss, rtol=1e-12, atol=1e-12)
    width = tight_logp.shape[1]
    torch.testing.assert_close(padded_logp.grad[:, :width], tight_logp.grad, rtol=1e-12, atol=1e-12)
    assert bool((padded_logp.grad[:, width:] == 0).all())


# ------------------------------------------------------------------------------ metrics


def test_summarize_hand_values():
    # ratios over counted tokens: [2, 1] and [0.5] -> mean 3.5/3; p95 of sorted [0.5, 1, 2] at
    # position 0.95·2 = 1.9: 1 + 0.9·(2 − 1) = 1.9. Clipped (ppo, 0.8..1.2, A = 1): 2 -> 1 of 3.
    first = {
        "lp": [math.log(0.5)] * 2,
        "logprobs": [math.log(0.25), math.log(0.5)],
        "advantages": [1.0, 1.0],
    }
    second = {"lp": [math.log(0.25)], "logprobs": [math.log(0.5)], "advantages": [1.0]}
    outputs = [run("ppo", [row], ["logprobs", "advantages"])[2] for row in (first, second)]
    metrics = summarize(outputs)
    assert metrics["ratio:mean"] == pytest.approx(3.5 / 3, rel=1e-12)
    assert metrics["ratio_p95:max"] == pytest.approx(1.9, rel=1e-12)
    assert metrics["clipped_frac:mean"] == pytest.approx(1 / 3, rel=1e-12)
    # loss = −min(2, 1.2) − 1 − min(0.5, 0.8) = −2.7
    assert metrics["loss:sum"] == pytest.approx(-2.7, rel=1e-12)


@settings(max_examples=20, deadline=None)
@given(rows=row_lists(max_rows=5), data=st.data())
def test_summarize_is_identical_for_any_micro_batch_split(rows: list[Row], data: st.DataObject):
    config = LossConfig(kl_penalty_coef=0.1)
    keys = [*W, "ref_logprobs"]
    labels = data.draw(st.lists(st.integers(0, 3), min_size=len(rows), max_size=len(rows)))
    batch, logp = make_batch(rows, keys)
    entropy = torch.rand(
        logp.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    batch = LossBatch(batch.logp_BT, batch.inputs, batch.pad_mask_BT, entropy)
    whole = summarize([get_loss("ppo")(batch, config)])
    parts = []
    for part_rows in reversed(_partition(labels)):  # micro-batches in any order
        part = _rows_of(batch, logp, part_rows)
        part = LossBatch(part.logp_BT, part.inputs, part.pad_mask_BT, entropy[part_rows])
        parts.append(get_loss("ppo")(part, config))
    split = summarize(parts)
    counted = any(w != 0 for row in rows for w in row["weights"])
    names = {"ratio:mean", "ratio_p95:max", "clipped_frac:mean", "kl:mean", "entropy:mean"}
    assert names <= whole.keys() if counted else whole.keys() == {"loss:sum"}
    assert whole.keys() == split.keys()
    for key in whole.keys() - {"loss:sum"}:
        assert split[key] == whole[key], key  # sorted before summing: bit-identical
    assert split["loss:sum"] == pytest.approx(whole["loss:sum"], rel=1e-12, abs=1e-12)


def test_summarize_p95_matches_numpy():
    rows = seeded_rows(3, lengths=(30, 17, 25))
    out = run("ppo", rows, W)[2]
    assert out.mask_BT is not None
    ratios = out.per_token["ratio"][out.mask_BT].numpy()
    assert summarize([out])["ratio_p95:max"] == pytest.approx(
        float(np.percentile(ratios, 95)), rel=1e-12
    )


# ---------------------------------------------------------------------------- bad input


def test_registry_and_required_inputs():
    assert list(LOSSES) == [
        *("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "value")
    ]
    assert set(REQUIRED_INPUTS) == set(LOSSES)
    assert DEFAULT_THRESHOLDS == SPEC_THRESHOLDS
    assert resolved_thresholds("cispo", LossConfig()) == (0.0, 4.0)
    assert resolved_thresholds("ppo", LossConfig(epsilon_high=0.3)) == (0.8, 1.3)
    # epsilon_high defaults to epsilon (ART): lo = 1 − 0.3, hi = 1 + 0.3.
    assert resolved_thresholds("ppo", LossConfig(epsilon=0.3)) == (0.7, 1.3)
    assert resolved_thresholds("gspo", LossConfig(epsilon=0.2, epsilon_high=0.28)) == (0.8, 1.28)


def test_unknown_loss_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown loss 'pop'.*cross_entropy.*gspo"):
        get_loss("pop")
    with pytest.raises(ValueError, match="unknown loss"):
        check_inputs("stable_reinforce", ["target_tokens"])


def test_missing_input_names_key_and_loss():
    with pytest.raises(ValueError, match=r"'ppo' needs loss_fn_inputs\['advantages'\]"):
        check_inputs("ppo", ["target_tokens", "logprobs"])
    with pytest.raises(ValueError, match=r"'cross_entropy' needs loss_fn_inputs\['weights'\]"):
        run("cross_entropy", [{"lp": [-1.0]}], [])
    row = {"lp": [-1.0], "logprobs": [-1.0], "advantages": [1.0]}
    with pytest.raises(
        ValueError, match=r"truncated_importance_sampling needs .*'sampler_logprobs'"
    ):
        run("ppo", [row], POLICY, LossConfig(truncated_importance_sampling=2.0))
    with pytest.raises(ValueError, match=r"kl_penalty_coef > 0 needs .*'ref_logprobs'"):
        run("ppo", [row], POLICY, LossConfig(kl_penalty_coef=0.1))


def test_from_mapping_forms():
    # Tinker's keys; a bound left out is the loss's default (ppo's 1.2), as on Tinker.
    config = LossConfig.from_mapping(
        {"clip_low_threshold": 0.7, "beta": 1, "kl_mode": "advantage", "kimi_k2_tau": None},
        "ppo",
    )
    # Exact: 1 − (1 − x) == x for any bound x in [0.5, 2] (Sterbenz), so the thresholds that
    # arrive are the thresholds used.
    assert resolved_thresholds("ppo", config) == (0.7, 1.2)
    assert (config.dro_beta, config.kl_mode, config.kimi_k2_tau) == (1.0, "advantage", None)
    assert isinstance(config.dro_beta, float)
    assert resolved_thresholds("cispo", LossConfig.from_mapping({"clip_high_threshold": 5.0})) == (
        0.0,
        5.0,
    )
    eps = LossConfig.from_mapping({"epsilon": 0.2})
    assert resolved_thresholds("ppo", eps) == pytest.approx((0.8, 1.2))
    asym = LossConfig.from_mapping({"epsilon": 0.2, "epsilon_high": 0.28})
    assert resolved_thresholds("ppo", asym) == pytest.approx((0.8, 1.28))
    assert LossConfig.from_mapping({"dro_beta": 0.3}) == LossConfig(dro_beta=0.3)
    assert LossConfig.from_mapping({}) == LossConfig()


@pytest.mark.parametrize(
    ("values", "match"),
    [
        (
            {"clip_low_treshold": 0.5},
            "unknown loss config key 'clip_low_treshold'; did you mean 'clip_low_threshold'",
        ),
        ({"epsilonn": 0.2}, "did you mean 'epsilon'"),
        ({"epsilon": -0.1}, "option epsilon=-0.1 is invalid: expected in \\[0, 1\\]"),
        ({"epsilon": 1.5}, "option epsilon=1.5 is invalid: expected in \\[0, 1\\]"),
        (
            {"epsilon_high": -0.1},
            "option epsilon_high=-0.1 is invalid: expected a finite number >= 0",
        ),
        ({"epsilon": 0.2, "clip_low_threshold": 0.8}, "not both"),
        ({"beta": "big"}, "option dro_beta='big' is invalid: expected float .*Tinker's beta"),
        ({"beta": 0.1, "dro_beta": 0.2}, "dro_beta twice"),
        ({"clip_low_threshold": "low"}, "clip_low_threshold must be a number"),
        (
            {"clip_low_threshold": 1.5, "clip_high_threshold": 1.2},
            "clip_low_threshold \\(1.5\\) must be <= clip_high_threshold \\(1.2\\)",
        ),
        (
            {"clip_low_threshold": 1.1, "clip_high_threshold": 1.2},
            "option epsilon=.* is invalid: expected in \\[0, 1\\].*Tinker's clip_low_threshold",
        ),
        ({"clip_low_threshold": 0.9}, "without clip_high_threshold"),
        ({"mask_prob_ratio": 1}, "option mask_prob_ratio=1 is invalid: expected bool"),
        ({"importance_sampling_level": "tokens"}, "importance_sampling_level='tokens' is invalid"),
        ({"kl_estimator": "k2"}, "option kl_estimator='k2' is invalid: expected one of"),
        ({"kl_mode": "reward"}, "option kl_mode='reward' is invalid: expected one of"),
    ],
)
def test_from_mapping_rejects(values: dict[str, float | str | bool | None], match: str):
    with pytest.raises(ValueError, match=match):
        LossConfig.from_mapping(values)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        # lo = 1 − epsilon must be a ratio bound in [0, 1], hi = 1 + epsilon_high one >= 1.
        ({"epsilon": 1.2}, "option epsilon=1.2 is invalid: expected in \\[0, 1\\]"),
        ({"epsilon": -0.1}, "option epsilon=-0.1 is invalid: expected in \\[0, 1\\]"),
        ({"epsilon_high": -0.1}, "option epsilon_high=-0.1 is invalid: expected a finite number"),
        ({"epsilon_high": float("inf")}, "option epsilon_high=inf is invalid"),
        ({"dro_beta": -1.0}, "option dro_beta=-1.0 is invalid: expected a finite number >= 0"),
        ({"kimi_k2_tau": -0.5}, "option kimi_k2_tau=-0.5 is invalid: expected a finite number"),
        (
            {"truncated_importance_sampling": 0.0},
            "option truncated_importance_sampling=0.0 is invalid: expected a finite cap > 0",
        ),
        ({"kl_penalty_coef": float("nan")}, "option kl_penalty_coef=nan is invalid"),
        ({"importance_sampling_level": "seq"}, "importance_sampling_level='seq' is invalid"),
    ],
)
def test_config_post_init_rejects(kwargs: dict[str, object], match: str):
    with pytest.raises(ValueError, match=match):
        LossConfig(**kwargs)  # pyright: ignore[reportArgumentType]


def test_config_checked_against_the_loss():
    # A floor above ppo's default ceiling 1.2 (lo = 1.5) cannot be written: epsilon >= 0.
    with pytest.raises(ValueError, match=r"option epsilon=-0.5 is invalid"):
        LossConfig(epsilon=-0.5)
    with pytest.raises(ValueError, match="'cross_entropy' does not use \\['kimi_k2_tau'\\]"):
        check_config("cross_entropy", LossConfig(kimi_k2_tau=0.1))
    with pytest.raises(ValueError, match="'dro' does not use"):
        check_config("dro", LossConfig(importance_sampling_level="sequence"))
    with pytest.raises(ValueError, match="gspo is sequence-level"):
        check_config("gspo", LossConfig(importance_sampling_level="average"))
    with pytest.raises(ValueError, match="need mask_prob_ratio=True"):
        check_config("importance_sampling", LossConfig(epsilon_high=0.5))
    with pytest.raises(ValueError, match="no clip thresholds"):
        resolved_thresholds("dro", LossConfig())


def test_nan_logprobs_need_the_allow_flag():
    row = {
        "lp": [-1.0, -1.0],
        "logprobs": [-1.0, NAN],
        "advantages": [1.0, 1.0],
        "weights": [1.0, 1.0],
    }
    with pytest.raises(
        ValueError,
        match=r"loss_fn_inputs\['logprobs'\] is NaN/inf on 1 counted.*allow_training_without_logprobs",
    ):
        run("ppo", [row], W)
    # On a token with weight 0 (not counted) a NaN placeholder is fine.
    row["weights"] = [1.0, 0.0]
    assert run("ppo", [row], W)[0] == pytest.approx(-1.0, rel=1e-12)
    row["weights"] = [1.0, 1.0]
    row["sampler_logprobs"] = [NAN, -1.0]
    with pytest.raises(ValueError, match=r"'sampler_logprobs'\] is NaN"):
        run(
            "ppo",
            [{**row, "logprobs": [-1.0, -1.0]}],
            [*W, "sampler_logprobs"],
            LossConfig(truncated_importance_sampling=2.0),
        )
    row["ref_logprobs"] = [NAN, -1.0]
    with pytest.raises(ValueError, match=r"'ref_logprobs'\] is NaN"):
        run(
            "ppo",
            [row],
            [*W, "ref_logprobs"],
            LossConfig(kl_penalty_coef=0.1, allow_training_without_logprobs=True),
        )


def test_nan_logprobs_inside_the_sequence_ratio_mask_are_rejected():
    # Token 1 has weight 0 but enters gspo's sequence mean: its unknown q would bias s.
    row = {"lp": [-1.0, -1.0], "logprobs": [-1.0, NAN], "advantages": [1.0, 1.0]}
    row["weights"], row["sequence_ratio_mask"] = [1.0, 0.0], [1.0, 1.0]
    with pytest.raises(ValueError, match=r"'logprobs'\] is NaN/inf on 1 counted"):
        run("gspo", [row], [*W, "sequence_ratio_mask"])


def test_per_token_bounds_must_be_ordered():
    row = {"lp": [-1.0], "logprobs": [-1.0], "advantages": [1.0]}
    row["clip_low_threshold"], row["clip_high_threshold"] = [1.3], [1.2]
    with pytest.raises(ValueError, match="per-token clip bounds"):
        run("ppo", [row], [*POLICY, "clip_low_threshold", "clip_high_threshold"])


# Every per-token loss_fn_input a loss reads (written out: a key added to the losses without a
# shape check fails test_every_loss_input_key_is_shape_checked).
LOSS_INPUT_KEYS = [
    "target_tokens",
    "weights",
    "advantages",
    "logprobs",
    "mask",
    "sampler_logprobs",
    "ref_logprobs",
    "sequence_ratio_mask",
    "clip_low_threshold",
    "clip_high_threshold",
    "returns",  # the critic's value loss
    "old_values",
    "value_clip",
]


def _full_batch_inputs(b: int, t: int) -> dict[str, torch.Tensor]:
    """Well-shaped [B, T] values for every loss input."""
    inputs = {key: torch.full((b, t), 0.5) for key in LOSS_INPUT_KEYS}
    inputs["target_tokens"] = torch.zeros(b, t, dtype=torch.long)
    return inputs


def test_every_loss_input_key_is_shape_checked():
    assert sorted(PER_TOKEN_INPUTS) == sorted(LOSS_INPUT_KEYS)


@pytest.mark.parametrize("key", LOSS_INPUT_KEYS)
@pytest.mark.parametrize(
    "bad_shape",
    [(2, 4), (2, 1), (1, 3), (2, 3, 1), (6,)],
    ids=["T+1", "broadcast-B1", "broadcast-1T", "extra-dim", "flat"],
)
def test_misshaped_loss_input_names_key_and_shapes(key: str, bad_shape: tuple[int, ...]):
    # [B, T] = [2, 3]. A [B, T+1] input used to fail inside torch without naming the key, and a
    # broadcastable one ([B, 1] advantages) was silently applied to every token of its row.
    logp = torch.zeros(2, 3, requires_grad=True)
    inputs = _full_batch_inputs(2, 3)
    inputs[key] = torch.zeros(bad_shape, dtype=inputs[key].dtype)
    expected = rf"LossBatch.inputs\['{key}'\] has shape {re.escape(str(bad_shape))} but logp_BT "
    expected += r"has shape \(2, 3\): give exactly one value per target token"
    with pytest.raises(ValueError, match=expected):
        LossBatch(logp, inputs, torch.ones(2, 3))


@pytest.mark.parametrize("name", list(LOSSES))
def test_misshaped_advantages_rejected_before_any_loss(name: str):
    # The check runs when the batch is built, so no loss (nor the engine) sees a bad shape.
    inputs = _full_batch_inputs(2, 3)
    inputs["advantages"] = torch.ones(2, 1)
    with pytest.raises(ValueError, match=r"inputs\['advantages'\] has shape \(2, 1\)"):
        get_loss(name)(LossBatch(torch.zeros(2, 3), inputs, torch.ones(2, 3)), LossConfig())


def test_well_shaped_batch_and_other_keys_pass():
    # Keys no loss reads may have any shape (e.g. [B, T, K] extras passed through).
    inputs = {**_full_batch_inputs(2, 3), "top_k_logprobs": torch.zeros(2, 3, 5)}
    batch = LossBatch(torch.zeros(2, 3), inputs, torch.ones(2, 3), torch.zeros(2, 3))
    assert batch.inputs["top_k_logprobs"].shape == (2, 3, 5)


@pytest.mark.parametrize(
    ("logp_shape", "pad_shape", "entropy_shape", "match"),
    [
        ((6,), (6,), None, r"logp_BT must be 2-D \[B, T\], got shape \(6,\)"),
        ((2, 3), (2, 4), None, r"LossBatch.pad_mask_BT has shape \(2, 4\) but logp_BT has shape"),
        ((2, 3), (2, 3), (2, 1), r"LossBatch.entropy_BT has shape \(2, 1\) but logp_BT has"),
    ],
)
def test_misshaped_batch_tensors(
    logp_shape: tuple[int, ...],
    pad_shape: tuple[int, ...],
    entropy_shape: tuple[int, ...] | None,
    match: str,
):
    entropy = None if entropy_shape is None else torch.zeros(entropy_shape)
    with pytest.raises(ValueError, match=match):
        LossBatch(torch.zeros(logp_shape), {}, torch.ones(pad_shape), entropy)
