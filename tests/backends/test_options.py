"""Typed options: pyright rejects what a backend lacks; the runtime raises TypeError first."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import types
from collections.abc import Iterator
from dataclasses import MISSING, Field, fields, is_dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import pytest

from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.backends.options import (
    HELP,
    CoreRLFields,
    DPOConfig,
    DPOOptions,
    LocalRLOptions,
    LocalSFTOptions,
    PosttrainLossFields,
    RemoteDPOOptions,
    RLConfig,
    RLOptions,
    SFTConfig,
    SFTOptions,
    WeightsInProcessFields,
    option_names,
)
from posttrain.backends.ray import RayRLConfig, RayRLOptions
from posttrain.backends.tinker import TinkerBackend, TinkerRLConfig, TinkerRLOptions
from posttrain.trainer.config import from_options, option_fields, option_help

CASES = Path(__file__).parents[1] / "pyright_cases" / "wrong_options.py"
CONFIGS = (RLConfig, RayRLConfig, SFTConfig, DPOConfig)


def leaf_fields(config_type: type) -> Iterator[tuple[str, Field[Any]]]:
    """(flat key, field) of every non-group field, walking the dataclasses directly (not through
    posttrain's own flat view, which this checks)."""
    for f in fields(config_type):
        default = f.default_factory() if f.default_factory is not MISSING else None
        if is_dataclass(default):
            yield from leaf_fields(type(default))
        else:
            yield f.metadata.get("key") or f.name, f


@pytest.mark.parametrize("config", CONFIGS)
def test_flat_keys_and_nested_fields_correspond_one_to_one(config: type):
    leaves = list(leaf_fields(config))
    keys = [key for key, _ in leaves]
    assert len(keys) == len(set(keys)), keys  # no key names two fields
    assert keys == list(option_fields(config))
    # A key is its field's name, but for the loss's name: the field is Tinker's `loss_fn`.
    renamed = {key: f.name for key, f in leaves if key != f.name}
    assert renamed == ({} if config is SFTConfig else {"loss": "loss_fn"})
    assert all(f.metadata.get("help") for _, f in leaves)  # each option documents itself


def test_the_full_option_sets_list_exactly_the_configs_keys():
    assert option_names(LocalRLOptions) == set(option_fields(RLConfig))
    assert option_names(RayRLOptions) == set(option_fields(RayRLConfig))
    assert option_names(LocalSFTOptions) == set(option_fields(SFTConfig))
    assert option_names(SFTOptions) == set(option_fields(SFTConfig)) - {"packing"}
    assert option_names(DPOOptions) == set(option_fields(DPOConfig))
    assert option_names(RemoteDPOOptions) == set(option_fields(DPOConfig)) - {"reference"}


def atoms(annotation: object) -> set[object]:
    """The values a type admits, flattened: each Literal value, else the type itself."""
    if get_origin(annotation) in (Union, types.UnionType):
        return set().union(*(atoms(a) for a in get_args(annotation)))
    if get_origin(annotation) is Literal:
        return {("literal", v) for v in get_args(annotation)}
    return {annotation}


# Options a set declares narrower than their field: `loss` without None (the field's default,
# which means "ppo" or what `ppo` says) and, for Tinker, without dro and gspo;
# `advantage_estimator` without 'gae' where there is no critic.
NARROWED = {"loss", "advantage_estimator"}
OPTION_SETS = [
    (CoreRLFields, RLConfig),
    (RLOptions, RLConfig),
    (PosttrainLossFields, RLConfig),
    (WeightsInProcessFields, RLConfig),
    (LocalRLOptions, RLConfig),
    (RayRLOptions, RayRLConfig),
    (TinkerRLOptions, TinkerRLConfig),
    (SFTOptions, SFTConfig),
    (LocalSFTOptions, SFTConfig),
    (DPOOptions, DPOConfig),
    (RemoteDPOOptions, DPOConfig),
]


@pytest.mark.parametrize(("options_type", "config"), OPTION_SETS)
def test_each_option_set_declares_config_keys_with_the_fields_types(options_type, config):
    # The TypedDicts stay written out for pyright; this keeps them from drifting.
    found = option_fields(config)
    declared = get_type_hints(options_type)
    assert set(declared) <= set(found), sorted(set(declared) - set(found))
    for key, annotation in declared.items():
        field_atoms, set_atoms = atoms(found[key].annotation), atoms(annotation)
        if key in NARROWED:
            assert set_atoms and set_atoms <= field_atoms, (key, annotation)
        else:
            assert set_atoms == field_atoms, (key, annotation, found[key].annotation)
        # The set's documentation is derived from the field's help.
        assert f"{key}: {found[key].help}" in (options_type.__doc__ or "")


def test_help_is_derived_from_the_fields():
    rl, sft = option_help(RLConfig), option_help(SFTConfig)
    assert {**rl, **sft} == HELP
    shared = set(rl) & set(sft)
    assert shared == {"learning_rate", "grad_clip", "weight_decay", "save_checkpoint"}
    assert all(rl[key] == sft[key] for key in shared)  # one definition each


@pytest.mark.slow
def test_pyright_rejects_each_unsupported_option():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pyright",
            "--outputjson",
            "--project",
            str(CASES.parent),
            "--pythonpath",
            sys.executable,
            str(CASES),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    report = json.loads(proc.stdout)
    error_lines = {
        d["range"]["start"]["line"] + 1
        for d in report["generalDiagnostics"]
        if d["severity"] == "error"
    }
    lines = CASES.read_text().splitlines()
    expected = {i + 1 for i, line in enumerate(lines) if re.search(r"\)  # expect: \w+$", line)}
    assert expected, "the case file lost its markers"
    assert error_lines == expected, (error_lines, expected)
    for number in expected:
        name = re.search(r"# expect: (\w+)", lines[number - 1]).group(1)  # pyright: ignore[reportOptionalMemberAccess]
        messages = [
            d["message"]
            for d in report["generalDiagnostics"]
            if d["range"]["start"]["line"] + 1 == number
        ]
        assert any(name in m for m in messages), (number, messages)


async def test_runtime_rejects_unknown_option_before_looking_at_anything(tmp_path):
    backend = LocalBackend(tmp_path)
    model = TrainableModel(
        name="m", project="p", base_model="does-not-exist", lora_rank=8
    )  # never registered
    with pytest.raises(
        TypeError, match=r"LocalBackend.train\(\).*'learning_rat'.*did you mean 'learning_rate'"
    ):
        await backend.train(model, [], learning_rat=1e-5)  # pyright: ignore[reportCallIssue]
    with pytest.raises(TypeError, match=r"LocalBackend.train_sft\(\).*'kl_penalty_coef'"):
        await backend.train_sft(model, [], kl_penalty_coef=0.1)  # pyright: ignore[reportCallIssue]


async def test_tinker_refuses_packing_before_looking_at_anything(tmp_path):
    # Tinker's wire protocol carries datums, not how the server lays them out: packing cannot
    # be honoured, so it is refused, never dropped.
    backend = TinkerBackend(tmp_path, base_url="http://127.0.0.1:9", api_key="tml-x")
    model = TrainableModel(name="m", project="p", base_model="does-not-exist", lora_rank=8)
    with pytest.raises(TypeError, match=r"TinkerBackend.train_sft\(\).*'packing'"):
        await backend.train_sft(model, [], packing=True)  # pyright: ignore[reportCallIssue]


# At least one wrong value per option, each wrong in its own way (type, choice, range, NaN).
BAD_RL_VALUES: dict[str, list[object]] = {
    "learning_rate": [-1e-5, math.nan, math.inf, "1e-5"],
    "loss": ["sgd", 1],
    "ppo": ["yes", 1],
    "epsilon": [-0.1, 1.5, "0.2"],
    "epsilon_high": [-0.1, math.nan],
    "dro_beta": [-1.0, None],
    "importance_sampling_level": ["tokens", 1],
    "advantage_estimator": ["ppo", None],
    "scale_rewards": [1, "yes"],
    "advantage_balance": [2.0, -1.5, math.nan],
    "zero_variance_groups": ["skip", True],
    "loss_reduction": ["mean", None],
    "loss_reduction_constant": [0.0, -2.0, math.inf],
    "algorithm_mode": ["maxrl", 1],
    "token_transform": ["gtpo_sepaa", None],
    "uncertainty_kind": ["entropy", None, 1],
    "gtpo_beta": [-0.1, math.nan],
    "hicra_alpha": [-1.0, math.inf],
    "entropy_mask_rho": [0.0, 1.5],
    "strategic_grams": [",,", "let me check,", 1],
    "sepa_schedule": ["cosine", None],
    "sepa_steps": [-1, 1.5],
    "sepa_delay_steps": [-1, None],
    "sepa_correct_rate_gate": [1.5, -0.1],
    "sepa_warmup_steps": [0, 2.0],
    "sepa_ema_decay": [1.0, -0.1, math.nan],
    "truncated_importance_sampling": [0.0, -1.0],
    "mask_prob_ratio": [0, "no"],
    "max_negative_advantage_importance_sampling_weight": [0.0, -1.0, math.inf, "2"],
    "kimi_k2_tau": [-0.5, math.inf],
    "allow_training_without_logprobs": [1, None],
    "teacher": ["a-model-name", 1],
    "distill_reward_coef": [-0.5, math.inf, None],
    "num_minibatches": [0, 1.5, True],
    "update_epochs": [0, 2.0, None],
    "gae_gamma": [1.5, -0.1, math.nan],
    "gae_lambda": [1.01, None],
    "value_clip": [0.0, -0.2, math.inf],
    "critic_learning_rate": [-1e-4, math.nan],
    "grad_clip": [-1.0, math.nan],
    "weight_decay": [-1.0, math.nan, math.inf],
    "save_checkpoint": ["true", None],
    "kl_penalty_coef": [-0.1, math.nan],
    "kl_estimator": ["k2", None],
    "kl_mode": ["both", None],
    "precalculate_logprobs": [None, 0],
    "logprob_calculation_chunk_size": [0, 8.0],
    "plot_tensors": [1, None],
    "verbose": [1, "yes"],
    "scale_learning_rate_by_reward_std_dev": [True, 1],
}
BAD_SFT_VALUES: dict[str, list[object]] = {
    "learning_rate": [-1e-4, math.nan],
    "lr_schedule": ["step", None],
    "warmup_steps": [-1, 1.0],
    "min_lr_ratio": [1.5, -0.1],
    "batch_size": [0, 2.0],
    "epochs": [0, None],
    "assistant_turns": ["first", None],
    "grad_clip": [-1.0, math.nan],
    "weight_decay": [-1.0, math.inf],
    "shuffle_seed": ["0", 1.5, None],
    "save_checkpoint": [1, None],
    "packing": [1, "true", None],
}


BAD_DPO_VALUES: dict[str, list[object]] = {
    "learning_rate": [-1e-4, math.nan],
    "beta": [0.0, -0.1, math.inf, "0.1"],
    "loss": ["hinge", None],
    "reference": ["sft", None],
    "batch_size": [0, 2.0],
    "epochs": [0, None],
    "grad_clip": [-1.0, math.nan],
    "weight_decay": [-1.0, math.inf],
    "shuffle_seed": ["0", 1.5],
    "save_checkpoint": [1, None],
}


def test_every_option_has_wrong_values_in_the_table():
    assert set(BAD_RL_VALUES) == option_names(LocalRLOptions)
    assert set(BAD_SFT_VALUES) == option_names(LocalSFTOptions)
    assert set(BAD_DPO_VALUES) == option_names(DPOOptions)


@pytest.mark.parametrize(
    ("call", "name", "value"),
    [("train", n, v) for n, values in BAD_RL_VALUES.items() for v in values]
    + [("train_sft", n, v) for n, values in BAD_SFT_VALUES.items() for v in values]
    + [("train_dpo", n, v) for n, values in BAD_DPO_VALUES.items() for v in values],
)
async def test_each_wrong_value_is_a_value_error_naming_the_option(tmp_path, call, name, value):
    # The model is never registered and its base model does not exist: the option is checked
    # before either is looked at (otherwise the error would say "not registered").
    backend = LocalBackend(tmp_path)
    model = TrainableModel(name="m", project="p", base_model=str(tmp_path / "missing"), lora_rank=8)
    with pytest.raises(ValueError, match=rf"\boption {name}=") as caught:
        await getattr(backend, call)(model, [], **{name: value})
    assert "not registered" not in str(caught.value)
    assert not (tmp_path / "p").exists()  # nothing written


def test_constant_reduction_names_the_option_it_needs():
    with pytest.raises(ValueError, match="loss_reduction_constant is needed by"):
        from_options(RLConfig, {"loss_reduction": "constant"})
    options = {"loss_reduction": "constant", "loss_reduction_constant": 64.0}
    assert from_options(RLConfig, options).advantages.loss_reduction_constant == 64.0
