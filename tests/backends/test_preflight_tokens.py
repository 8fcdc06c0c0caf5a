"""Preflight of the token-level advantage flow: the probe runs every transform on synthetic
groups, a backend that keeps one advantage per sequence refuses token-varying flows, a kind
whose data the backend lacks is named with the backends that have it, and options the
configured transform ignores are refused."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from posttrain.backends.capabilities import LOCAL
from posttrain.backends.plugins import registry
from posttrain.backends.preflight import PreflightError, preflight_rl
from posttrain.backends.probe import probe_advantage_flow
from posttrain.trainer.config import RLConfig, from_options

TOKEN_VARYING = [
    {"token_transform": "gtpo"},
    {"token_transform": "gtpo_hicra"},
    {"token_transform": "gtpo_sepa"},
    {"token_transform": "entropy_mask"},
    {"token_transform": "gtpo", "uncertainty_kind": "predictive_variance"},
    {"algorithm_mode": "maxrl_gtpo"},
    {"algorithm_mode": "maxrl_gtpo_hicra"},
    {"algorithm_mode": "maxrl_gtpo_sepa"},
    {"algorithm_mode": "reinforce_pp_gtpo"},
    {"algorithm_mode": "reinforce_pp_gtpo_sepa"},
]
ONE_PER_SEQUENCE = [
    {"algorithm_mode": "grpo_none"},
    {"algorithm_mode": "maxrl_none"},
    {"algorithm_mode": "reinforce_pp_none"},  # whitening is affine: equal tokens stay equal
    {"advantage_estimator": "reinforce_pp"},
]


@pytest.fixture(autouse=True)
def plugins_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "trainer"))  # custom_kinds


@pytest.fixture
def non_preserving():
    """LocalPlugin's capabilities (one advantage per sequence), with entropies so that only
    the advantages are at issue."""
    caps = registry.describe("plugin_example:LocalPlugin").capabilities
    assert not caps.preserves_token_advantages
    return replace(caps, provides_token_entropies=True)


@pytest.mark.parametrize("options", TOKEN_VARYING, ids=str)
def test_the_probe_finds_every_token_varying_flow(options):
    finding = probe_advantage_flow(from_options(RLConfig, options))
    assert finding is not None and finding.quantity == "advantages"
    assert finding.high - finding.low > 1e-3  # far above the probe's 1e-6 tolerance


@pytest.mark.parametrize("options", ONE_PER_SEQUENCE, ids=str)
def test_flows_with_one_advantage_per_sequence_pass_everywhere(options, non_preserving):
    config = from_options(RLConfig, options)
    assert probe_advantage_flow(config) is None
    preflight_rl("LocalPlugin", non_preserving, config)


@pytest.mark.parametrize("options", TOKEN_VARYING, ids=str)
def test_token_varying_flows_are_refused_where_advantages_are_one_per_sequence(
    options, non_preserving
):
    config = from_options(RLConfig, options)
    preflight_rl("LocalBackend", replace(LOCAL, provides_token_entropies=True), config)
    with pytest.raises(PreflightError) as raised:
        preflight_rl("LocalPlugin", non_preserving, config)
    (problem,) = raised.value.problems
    assert problem.option == next(iter(options))  # token_transform or algorithm_mode
    assert f"{problem.option}={options[problem.option]!r} gives each token its own" in (
        problem.message
    )
    assert "does not preserve token-level advantages" in problem.message
    assert "the advantage-flow probe gave the" in problem.message


def test_shannon_entropy_needs_a_backend_that_provides_entropies():
    config = from_options(
        RLConfig, {"token_transform": "gtpo_sepa", "uncertainty_kind": "shannon_entropy"}
    )
    without = replace(LOCAL, provides_token_entropies=False)
    with pytest.raises(PreflightError) as raised:
        preflight_rl("SomeBackend", without, config)
    (problem,) = raised.value.problems
    assert problem.option == "uncertainty_kind"
    message = problem.message
    assert "uncertainty_kind='shannon_entropy' reads per-token entropies" in message
    assert "SomeBackend does not provide (provides_token_entropies=false)" in message
    having = [
        registry.describe(name).label
        for name in registry.BUILTINS
        if registry.describe(name).capabilities.provides_token_entropies
    ]
    assert f"use a backend that does ({', '.join(having) or 'none installed here'})" in message
    assert "TinkerBackend" not in message.split("use a backend that does")[1].split(")")[0]
    preflight_rl("SomeBackend", replace(LOCAL, provides_token_entropies=True), config)
    # Without a token transform the kind is never read: nothing to refuse.
    preflight_rl("SomeBackend", without, RLConfig())


def test_a_custom_kind_that_reads_entropies_says_so():
    config = from_options(
        RLConfig, {"token_transform": "gtpo", "uncertainty_kind": "custom_kinds:entropy_gap"}
    )
    with pytest.raises(
        PreflightError, match="'custom_kinds:entropy_gap' reads per-token entropies"
    ):
        preflight_rl("SomeBackend", replace(LOCAL, provides_token_entropies=False), config)


def test_a_bad_custom_kind_fails_preflight_even_where_token_advantages_are_kept():
    config = from_options(
        RLConfig, {"token_transform": "gtpo", "uncertainty_kind": "custom_kinds:short"}
    )
    with pytest.raises(PreflightError) as raised:
        preflight_rl("LocalBackend", LOCAL, config)
    (problem,) = raised.value.problems
    assert problem.option == "advantages"
    assert "the advantage-flow probe failed on synthetic groups" in problem.message
    assert "uncertainty_kind='custom_kinds:short' returned 2 values for a completion of 3" in (
        problem.message
    )
    missing = from_options(
        RLConfig, {"token_transform": "gtpo", "uncertainty_kind": "no_such_module_xyz:kind"}
    )
    with pytest.raises(PreflightError, match="module 'no_such_module_xyz' does not import"):
        preflight_rl("LocalBackend", replace(LOCAL, provides_token_entropies=True), missing)


@pytest.mark.parametrize(
    ("options", "option", "message"),
    [
        ({"gtpo_beta": 0.3}, "gtpo_beta", "not 'none'"),
        ({"uncertainty_kind": "predictive_variance"}, "uncertainty_kind", "not 'none'"),
        ({"token_transform": "gtpo", "hicra_alpha": 0.5}, "hicra_alpha", "'gtpo_hicra', not"),
        (
            {"token_transform": "gtpo", "entropy_mask_rho": 0.5},
            "entropy_mask_rho",
            "'entropy_mask'",
        ),
        ({"token_transform": "gtpo", "strategic_grams": "hmm"}, "strategic_grams", "'gtpo_hicra'"),
        (
            {"algorithm_mode": "maxrl_gtpo", "sepa_steps": 10},
            "sepa_steps",
            "'gtpo_sepa', not 'gtpo'",
        ),
        (
            {"token_transform": "gtpo_sepa", "sepa_steps": 0},
            "sepa_steps",
            "lambda stays 0 and gtpo_sepa is plain gtpo",
        ),
        (
            {"algorithm_mode": "maxrl_none", "scale_rewards": False},
            "scale_rewards",
            "'maxrl' never scales",
        ),
    ],
)
def test_options_the_flow_ignores_are_refused(options, option, message):
    with pytest.raises(PreflightError) as raised:
        preflight_rl("LocalBackend", LOCAL, from_options(RLConfig, options))
    assert [p.option for p in raised.value.problems] == [option]
    assert message in str(raised.value)


def test_auto_sepa_without_a_linear_ramp_is_fine():
    options = {"token_transform": "gtpo_sepa", "sepa_schedule": "auto", "sepa_steps": 0}
    preflight_rl("LocalBackend", LOCAL, from_options(RLConfig, options))
