"""Preflight rejects each configuration a backend would silently degrade."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from posttrain.backends import preflight
from posttrain.backends.capabilities import CONSERVATIVE, LOCAL
from posttrain.backends.plugins import registry
from posttrain.backends.preflight import (
    PreflightError,
    preflight_rl,
    preflight_sft,
)
from posttrain.backends.probe import probe_advantage_flow
from posttrain.backends.register_checks import model_problems
from posttrain.data.trajectories import TokenSegment, Trajectory, TrajectoryGroup
from posttrain.trainer.config import RLConfig, SFTConfig, from_options


@pytest.fixture(autouse=True)
def plugin_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


def test_default_config_passes_everywhere():
    preflight_rl("LocalBackend", LOCAL, RLConfig())
    preflight_rl("Plugin", CONSERVATIVE, RLConfig())


@pytest.mark.parametrize(
    ("options", "option", "message"),
    [
        (
            {"truncated_importance_sampling": 2.0},
            "truncated_importance_sampling",
            "precalculate_logprobs",
        ),
        ({"kl_estimator": "k1"}, "kl_estimator", "kl_penalty_coef=0"),
        ({"loss_reduction_constant": 64.0}, "loss_reduction_constant", "loss_reduction='constant'"),
        ({"dro_beta": 0.1}, "dro_beta", "loss='dro'"),
        ({"advantage_estimator": "rloo", "scale_rewards": False}, "scale_rewards", "rloo"),
        ({"loss": "importance_sampling", "epsilon": 0.2}, "loss", "clip"),
    ],
)
def test_conflicting_options(options, option, message):
    with pytest.raises(PreflightError) as info:
        preflight_rl("LocalBackend", LOCAL, from_options(RLConfig, options))
    assert [p.option for p in info.value.problems] == [option]
    assert message in str(info.value) and "LocalBackend" in str(info.value)


def test_kl_needs_a_reference_model():
    with pytest.raises(PreflightError, match=r"kl_penalty_coef: Plugin cannot score tokens"):
        preflight_rl("Plugin", CONSERVATIVE, from_options(RLConfig, dict(kl_penalty_coef=0.1)))


# Hand-derived probe results on synthetic sequence 0: prompt (1, 2, 3) + sampled (10, 11, 12)
# with reward 1.0 in the group (1.0, 0.0, 0.5). GRPO: mean 0.5, population std
# sqrt((0.25 + 0.25 + 0) / 3) = 0.408248, so A = 0.5 / (0.408248 + 1e-6) = 1.224742.
# Its trained targets sit at positions t = 3, 4, 5 of the padded row; the probe's learner
# logprobs are q_t + 0.01 t and its reference ones lp_t - 0.02 t.
A0 = 0.5 / ((0.5 / 3) ** 0.5 + 1e-6)


def test_probe_finds_kimi_tau_per_token():
    # A_t - tau (lp_t - q_t) = A - 0.5 * 0.01 t: A - 0.015, A - 0.020, A - 0.025.
    finding = probe_advantage_flow(from_options(RLConfig, dict(kimi_k2_tau=0.5)))
    assert finding is not None and (finding.sequence, finding.quantity, finding.tokens) == (
        0,
        "advantages",
        3,
    )
    # fp32 advantages of size ~1.2: 1e-6 is a few ulps (1.2 * 2**-23 = 1.4e-7 each).
    assert finding.low == pytest.approx(A0 - 0.025, abs=1e-6)
    assert finding.high == pytest.approx(A0 - 0.015, abs=1e-6)


def test_probe_finds_kl_shaping_per_token():
    # k1_t = lp_t - ref_t = 0.02 t = 0.06, 0.08, 0.10 (mean 0.08); shaped A_t = A + 0.5 (0.08 - k_t).
    finding = probe_advantage_flow(
        from_options(RLConfig, dict(kl_penalty_coef=0.5, kl_mode="advantage", kl_estimator="k1"))
    )
    assert finding is not None and finding.quantity == "advantages"
    assert finding.low == pytest.approx(A0 - 0.01, abs=1e-6)
    assert finding.high == pytest.approx(A0 + 0.01, abs=1e-6)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"loss_reduction": "sequence_mean"},
        {"loss_reduction": "constant", "loss_reduction_constant": 64.0},
        {"loss_reduction": "sum"},
        {"advantage_estimator": "rloo"},
        {"advantage_estimator": "maxrl"},
        {"advantage_balance": 0.5},
        {"zero_variance_groups": "keep"},
        {"kl_penalty_coef": 0.5},  # kl_mode="loss": a separate term, advantages untouched
        {"kimi_k2_tau": 0.0},
        {"loss": "cispo", "importance_sampling_level": "sequence"},
    ],
)
def test_probe_passes_flows_that_keep_one_value_per_sequence(options):
    assert probe_advantage_flow(from_options(RLConfig, options)) is None


@pytest.mark.parametrize(
    ("options", "option"),
    [
        ({"kimi_k2_tau": 0.1}, "kimi_k2_tau"),
        ({"kl_penalty_coef": 0.1, "kl_mode": "advantage"}, "kl_mode"),
    ],
)
def test_token_varying_advantages_need_a_preserving_backend(options, option):
    preflight_rl("LocalBackend", LOCAL, from_options(RLConfig, options))
    # LocalPlugin's capabilities, with a reference model so that only the advantages are at issue.
    caps = replace(
        registry.describe("plugin_example:LocalPlugin").capabilities, supports_kl_reference=True
    )
    with pytest.raises(PreflightError) as info:
        preflight_rl("LocalPlugin", caps, from_options(RLConfig, options))
    (problem,) = info.value.problems
    assert problem.option == option
    assert "does not preserve token-level advantages" in problem.message
    assert "the advantage-flow probe gave the 3 tokens of synthetic sequence 0" in problem.message


def test_the_probe_alone_catches_token_varying_advantages(monkeypatch):
    # With no static rule at all, the probe still refuses the flow: it runs the real functions.
    monkeypatch.setattr(preflight, "TOKEN_VARYING_OPTIONS", ())
    info = registry.describe("plugin_example:LocalPlugin")
    with pytest.raises(PreflightError) as raised:
        preflight_rl(
            "LocalPlugin",
            info.capabilities,
            from_options(RLConfig, dict(kimi_k2_tau=0.1)),
            options=info.train_options,
        )
    (problem,) = raised.value.problems
    assert problem.option == "advantages"
    assert problem.message.startswith(
        "the advantage-flow probe gave the 3 tokens of synthetic sequence 0 advantages"
    )
    # The same options on a backend that preserves token advantages pass.
    preflight_rl(
        "LocalBackend",
        LOCAL,
        from_options(RLConfig, dict(kimi_k2_tau=0.1)),
        options=registry.describe("local").train_options,
    )


def test_options_a_plugin_does_not_declare_are_refused():
    info = registry.describe("plugin_example:LocalPlugin")
    with pytest.raises(PreflightError) as raised:
        preflight_rl(
            "LocalPlugin",
            info.capabilities,
            from_options(RLConfig, dict(num_minibatches=2, loss="dro")),
            options=info.train_options,
        )
    messages = {p.option: p.message for p in raised.value.problems}
    assert messages["num_minibatches"].startswith(
        "LocalPlugin.train() does not take this option (set to 2); remove it"
    )
    assert (
        "LocalPlugin takes: kimi_k2_tau, learning_rate, loss, save_checkpoint"
        in messages["num_minibatches"]
    )
    assert messages["loss"] == (
        "'dro' is not one of the choices LocalPlugin.train() declares ['ppo', 'cispo']; "
        "pick one of those or another backend"
    )
    # Undeclared options left at their default are fine: the job simply does not pass them.
    preflight_rl(
        "LocalPlugin",
        info.capabilities,
        from_options(RLConfig, dict(learning_rate=1e-3)),
        options=info.train_options,
    )


def test_a_plugin_without_a_schema_takes_no_options():
    with pytest.raises(
        PreflightError, match=r"learning_rate: Plain.train\(\) does not take .*none declared"
    ):
        preflight_rl(
            "Plain", CONSERVATIVE, from_options(RLConfig, dict(learning_rate=1e-3)), options=[]
        )


def test_losses_outside_a_builtin_schema_are_refused():
    # TinkerBackend declares only the losses Tinker's protocol carries.
    info = registry.describe("tinker")
    with pytest.raises(
        PreflightError, match=r"loss: 'gspo' is not one of the choices TinkerBackend"
    ):
        preflight_rl(
            "TinkerBackend",
            info.capabilities,
            from_options(RLConfig, dict(loss="gspo")),
            options=info.train_options,
        )
    preflight_rl(
        "TinkerBackend",
        info.capabilities,
        from_options(RLConfig, dict(loss="cispo")),
        options=info.train_options,
    )


def test_sft_options_are_checked_against_the_schema():
    info = registry.describe("plugin_example:LocalPlugin")
    with pytest.raises(
        PreflightError, match=r"warmup_steps: LocalPlugin.train_sft\(\) does not take"
    ):
        preflight_sft(
            "LocalPlugin",
            info.capabilities,
            from_options(SFTConfig, dict(warmup_steps=2)),
            options=info.train_sft_options,
        )
    preflight_sft(
        "LocalPlugin",
        info.capabilities,
        from_options(SFTConfig, dict(epochs=3)),
        options=info.train_sft_options,
    )


def test_packing_on_tinker_is_refused_by_a_job_preflight():
    # `[sft] packing = true` with backend = "tinker": refused, never silently dropped.
    tinker, local = registry.describe("tinker"), registry.describe("local")
    packed = from_options(SFTConfig, {"packing": True})
    with pytest.raises(PreflightError, match=r"packing: TinkerBackend.train_sft\(\) does not take"):
        preflight_sft(
            "TinkerBackend", tinker.capabilities, packed, options=tinker.train_sft_options
        )
    preflight_sft("LocalBackend", local.capabilities, packed, options=local.train_sft_options)


def test_missing_logprobs_found_before_any_work():
    group = TrajectoryGroup(
        (
            Trajectory((TokenSegment((1,)), TokenSegment((2,), trainable=True)), 1.0),
            Trajectory((TokenSegment((1,)), TokenSegment((3,), trainable=True)), 0.0),
        )
    )
    with pytest.raises(PreflightError, match="allow_training_without_logprobs"):
        preflight_rl("LocalBackend", LOCAL, RLConfig(), [group])
    preflight_rl(
        "LocalBackend",
        LOCAL,
        from_options(RLConfig, dict(allow_training_without_logprobs=True)),
        [group],
    )


def test_sft_needs_support():
    with pytest.raises(PreflightError, match="does not support SFT"):
        preflight_sft("Plugin", CONSERVATIVE, SFTConfig())


def test_ppo_is_judged_as_the_loss_it_means():
    """LocalPlugin declares `loss` (ppo, cispo) but not `ppo`: ppo=False is loss "cispo", which
    it takes, so nothing is refused; ppo=False is loss "cispo", the default (ART's)."""
    info = registry.describe("plugin_example:LocalPlugin")
    assert "ppo" not in {o.name for o in info.train_options}
    for ppo in (False, True):
        preflight_rl(
            "LocalPlugin",
            info.capabilities,
            from_options(RLConfig, dict(ppo=ppo)),
            options=info.train_options,
        )
    # A backend that declares neither refuses ppo=True under both names the user may look for.
    hooked = registry.describe("plugin_example:HookedBackend")
    with pytest.raises(PreflightError) as raised:
        preflight_rl(
            "HookedBackend",
            hooked.capabilities,
            from_options(RLConfig, dict(ppo=True)),
            options=hooked.train_options,
        )
    assert [p.option for p in raised.value.problems] == ["loss", "ppo"]


def test_full_finetuning_on_a_lora_only_backend_is_refused_before_anything_loads(tmp_path):
    """TinkerBackend declares supports_full_finetuning=false: a model without lora_rank is
    refused by a check that needs no model (what `posttrain explain` can run), and register
    refuses it with the same message before the base model is even looked at."""
    import asyncio

    from posttrain.backends.model import TrainableModel
    from posttrain.backends.tinker import TINKER, TinkerBackend

    [problem] = model_problems("TinkerBackend", TINKER, 0)  # a job's [model] lora_rank = 0
    assert problem.option == "lora_rank"
    assert "trains LoRA adapters only" in problem.message and "LocalBackend" in problem.message
    assert model_problems("TinkerBackend", TINKER, None) == [problem]
    assert model_problems("TinkerBackend", TINKER, 8) == []
    assert model_problems("LocalBackend", LOCAL, None) == []
    assert CONSERVATIVE.supports_full_finetuning  # a plugin that cannot says so itself
    full = TrainableModel(name="m", project="p", base_model="does-not-exist", lora_rank=None)
    with pytest.raises(ValueError, match=r"lora_rank.*\[model\] lora_rank = 8"):
        asyncio.run(full.register(TinkerBackend(tmp_path, base_url="http://127.0.0.1:9")))


def test_gae_on_a_backend_without_a_critic_is_one_problem_saying_why():
    """TinkerBackend's declared choices lack 'gae' (a pyright error there): preflight names it
    once, with the reason, not also as a value outside the choices."""
    tinker = registry.describe("tinker")
    config = from_options(RLConfig, {"advantage_estimator": "gae"})
    with pytest.raises(PreflightError) as raised:
        preflight_rl(tinker.label, tinker.capabilities, config, options=tinker.train_options)
    [problem] = raised.value.problems
    assert problem.option == "advantage_estimator" and "needs a learned critic" in problem.message
    (row,) = [o for o in tinker.train_options if o.name == "advantage_estimator"]
    assert row.choices == ("grpo", "rloo", "dr_grpo", "maxrl", "reinforce_pp")
