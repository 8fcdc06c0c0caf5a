"""Preflight rejects each configuration a backend would silently degrade."""

from __future__ import annotations

import pytest

from posttrain.backends.capabilities import CONSERVATIVE, LOCAL
from posttrain.backends.preflight import PreflightError, preflight_rl, preflight_sft
from posttrain.trainer.config import RLConfig, SFTConfig
from posttrain.types import TokenSegment, Trajectory, TrajectoryGroup


def test_default_config_passes_everywhere():
    preflight_rl("LocalBackend", LOCAL, RLConfig())
    preflight_rl("Plugin", CONSERVATIVE, RLConfig())


@pytest.mark.parametrize(
    ("options", "option", "message"),
    [
        ({"truncated_importance_sampling": 2.0}, "truncated_importance_sampling", "precalculate_logprobs"),
        ({"kl_estimator": "k1"}, "kl_estimator", "kl_penalty_coef=0"),
        ({"loss_reduction_constant": 64.0}, "loss_reduction_constant", "loss_reduction='constant'"),
        ({"dro_beta": 0.1}, "dro_beta", "loss='dro'"),
        ({"advantage_estimator": "rloo", "scale_rewards": False}, "scale_rewards", "rloo"),
        ({"loss": "importance_sampling", "epsilon": 0.2}, "loss", "clip"),
    ],
)
def test_conflicting_options(options, option, message):
    with pytest.raises(PreflightError) as info:
        preflight_rl("LocalBackend", LOCAL, RLConfig(**options))
    assert [p.option for p in info.value.problems] == [option]
    assert message in str(info.value) and "LocalBackend" in str(info.value)


def test_kl_needs_a_reference_model():
    with pytest.raises(PreflightError, match=r"kl_penalty_coef: Plugin cannot score tokens"):
        preflight_rl("Plugin", CONSERVATIVE, RLConfig(kl_penalty_coef=0.1))


@pytest.mark.parametrize("options", [{"kimi_k2_tau": 0.1}])
def test_token_varying_advantages_need_a_preserving_backend(options):
    preflight_rl("LocalBackend", LOCAL, RLConfig(**options))
    with pytest.raises(PreflightError, match=r"advantages: kimi_k2_tau.*does not preserve token-level"):
        preflight_rl("Plugin", CONSERVATIVE, RLConfig(**options))


def test_missing_logprobs_found_before_any_work():
    group = TrajectoryGroup(
        (
            Trajectory((TokenSegment((1,)), TokenSegment((2,), trainable=True)), 1.0),
            Trajectory((TokenSegment((1,)), TokenSegment((3,), trainable=True)), 0.0),
        )
    )
    with pytest.raises(PreflightError, match="allow_training_without_logprobs"):
        preflight_rl("LocalBackend", LOCAL, RLConfig(), [group])
    preflight_rl("LocalBackend", LOCAL, RLConfig(allow_training_without_logprobs=True), [group])


def test_sft_needs_support():
    with pytest.raises(PreflightError, match="does not support SFT"):
        preflight_sft("Plugin", CONSERVATIVE, SFTConfig())
