"""The parity check's rules on hand values: which tokens it compares, its bound, its modes."""

from __future__ import annotations

import logging
from typing import Literal

import pytest

from posttrain.algo.agreement import AgreementSums
from posttrain.data.trajectories import POLICY_VERSION, SAMPLING_TEMPERATURE
from posttrain.trainer.parity import (
    PARITY_BOUNDS,
    ParityCheck,
    ParityError,
    on_policy_flags,
    parity_precision,
)


def check(mode: Literal["error", "warn"] = "error") -> ParityCheck:
    return ParityCheck(engine="vllm", model_step=3, precision="float32", mode=mode)


def test_only_tokens_of_the_trainers_version_at_temperature_1_or_0_are_on_policy():
    flags = on_policy_flags(
        check(),
        [
            {POLICY_VERSION: 3},  # on-policy, temperature unknown: 1
            {POLICY_VERSION: 2},  # one version stale (async RL)
            {},  # no version stamped: never compared
            {POLICY_VERSION: 3, SAMPLING_TEMPERATURE: 0.7},  # tempered logprobs
            {POLICY_VERSION: 3, SAMPLING_TEMPERATURE: 0.0},  # greedy: the raw distribution
        ],
    )
    assert flags == [True, False, False, False, True]
    assert on_policy_flags(None, [{POLICY_VERSION: 3}]) == [False]


def test_the_bound_is_on_the_mean_absolute_difference():
    bound = PARITY_BOUNDS["float32"]
    # δ = +3b and −3b: the mean δ is 0 (kl_sample_train_v1 would miss it), mean |δ| is 3b.
    opposite = AgreementSums(diff_sum=0.0, abs_max=3 * bound, count=2, abs_sum=6 * bound)
    with pytest.raises(ParityError) as caught:
        check().judge(opposite, served=3, expected=3, what="the tokens")
    message = str(caught.value)
    assert "'vllm' engine" in message and "claims policy version 3 (expected 3)" in message
    assert f"by {3 * bound:.3g} on average" in message and f"bound {bound:g}" in message
    assert "before any update" in message and "parity_check = 'warn'" in message
    # Exactly at the bound passes; nothing compared passes.
    at_bound = AgreementSums(abs_max=bound, count=4, abs_sum=4 * bound)
    check().judge(at_bound, served=3, expected=3, what="the tokens")
    check().judge(AgreementSums(), served=3, expected=3, what="the tokens")


def test_warn_logs_and_compared_adds_up(caplog: pytest.LogCaptureFixture):
    warn = check("warn")
    far = AgreementSums(abs_max=1.0, count=2, abs_sum=1.0)
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        warn.judge(far, served=2, expected=3, what="a probe", before_update=False)
    assert "claims policy version 2 (expected 3)" in caplog.text
    warn.judge(AgreementSums(count=3), served=3, expected=3, what="more")
    assert warn.compared.count == 5 and warn.compared.abs_sum == 1.0


def test_precision_is_the_looser_of_trainer_and_engine():
    assert parity_precision("float32", None) == "float32"
    assert parity_precision("float32", "float32") == "float32"
    assert parity_precision("float32", "bfloat16") == "bfloat16"
    assert parity_precision("bfloat16", None) == "bfloat16"
    assert parity_precision("float16", "float32") == "bfloat16"
