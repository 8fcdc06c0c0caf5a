"""Aliases are resolved once, when options are read: the config holds the canonical values.

`ppo` becomes `loss_fn`, ART's clip range fills a ppo or cispo loss's unset epsilon /
epsilon_high (ppo: 0.2 both sides; cispo: 1.0 low, 4.0 high, as in ART), and `algorithm_mode`
becomes `advantage_estimator` and `token_transform` (retrain's table: maxrl_gtpo_sepa is
maxrl + gtpo_sepa; its grpo is posttrain's dr_grpo). Every expected value is read off those
tables, so each test states the alias and what a reader finds.
"""

from __future__ import annotations

import pytest

from posttrain.trainer.config import RLConfig, from_options, option_values, with_options


def test_ppo_is_read_into_loss_fn_and_its_clip_range():
    config = from_options(RLConfig, {"ppo": True})
    assert config.loss_fn == "ppo"
    assert (config.loss_fn_config.epsilon, config.loss_fn_config.epsilon_high) == (0.2, 0.2)
    # The flat view a caller or `posttrain explain` sees is the canonical one too.
    assert option_values(config)["loss"] == "ppo"


def test_unset_loss_is_cispo_with_arts_clip_range():
    config = RLConfig()
    assert config.loss_fn == "cispo"
    assert (config.loss_fn_config.epsilon, config.loss_fn_config.epsilon_high) == (1.0, 4.0)


def test_a_given_clip_bound_is_kept_and_the_other_defaults_alone():
    config = from_options(RLConfig, {"loss": "cispo", "epsilon": 0.5})
    assert (config.loss_fn_config.epsilon, config.loss_fn_config.epsilon_high) == (0.5, 4.0)
    ppo = from_options(RLConfig, {"ppo": True, "epsilon_high": 0.3})
    assert (ppo.loss_fn_config.epsilon, ppo.loss_fn_config.epsilon_high) == (0.2, 0.3)


def test_losses_without_an_art_range_keep_their_unset_bounds():
    config = from_options(RLConfig, {"loss": "gspo"})
    assert (config.loss_fn_config.epsilon, config.loss_fn_config.epsilon_high) == (None, None)


def test_algorithm_mode_is_read_into_estimator_and_transform():
    config = from_options(RLConfig, {"algorithm_mode": "maxrl_gtpo_sepa"}).advantages
    assert config.advantage_estimator == "maxrl"
    assert config.tokens.token_transform == "gtpo_sepa"
    assert config.algorithm_mode == "maxrl_gtpo_sepa"  # what was given, for messages


def test_reading_a_canonical_config_again_changes_nothing():
    for options in ({"ppo": True}, {"algorithm_mode": "grpo_none"}, {"loss": "cispo"}, {}):
        config = from_options(RLConfig, options)
        assert from_options(RLConfig, option_values(config)) == config
        assert with_options(config, learning_rate=2e-5).loss_fn_config == config.loss_fn_config


def test_an_explicit_default_loss_that_ppo_contradicts_is_refused():
    # `loss` at its default value, but given: the read-time check sees it.
    with pytest.raises(ValueError, match=r"loss='cispo' and ppo=True disagree"):
        from_options(RLConfig, {"loss": "cispo", "ppo": True})
