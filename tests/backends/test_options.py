"""Typed options: pyright rejects what a backend lacks; the runtime raises TypeError first."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from posttrain.backends.local import LocalBackend
from posttrain.backends.options import (
    LocalRLOptions,
    RLConfig,
    SFTConfig,
    SFTOptions,
    option_names,
)
from posttrain.model import TrainableModel

CASES = Path(__file__).parents[1] / "pyright_cases" / "wrong_options.py"


def test_option_sets_and_configs_name_the_same_keys():
    assert option_names(LocalRLOptions) == {f.name for f in fields(RLConfig)}
    assert option_names(SFTOptions) == {f.name for f in fields(SFTConfig)}


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
        name = re.search(r"# expect: (\w+)", lines[number - 1]).group(1)  # type: ignore[union-attr]
        messages = [
            d["message"]
            for d in report["generalDiagnostics"]
            if d["range"]["start"]["line"] + 1 == number
        ]
        assert any(name in m for m in messages), (number, messages)


async def test_runtime_rejects_unknown_option_before_looking_at_anything(tmp_path):
    backend = LocalBackend(tmp_path)
    model = TrainableModel(name="m", project="p", base_model="does-not-exist")  # never registered
    with pytest.raises(
        TypeError, match=r"LocalBackend.train\(\).*'learning_rat'.*did you mean 'learning_rate'"
    ):
        await backend.train(model, [], learning_rat=1e-5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"LocalBackend.train_sft\(\).*'kl_penalty_coef'"):
        await backend.train_sft(model, [], kl_penalty_coef=0.1)  # type: ignore[call-arg]


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
    "truncated_importance_sampling": [0.0, -1.0],
    "mask_prob_ratio": [0, "no"],
    "kimi_k2_tau": [-0.5, math.inf],
    "allow_training_without_logprobs": [1, None],
    "num_minibatches": [0, 1.5, True],
    "grad_clip": [-1.0, math.nan],
    "weight_decay": [-1.0, math.nan, math.inf],
    "save_checkpoint": ["true", None],
    "kl_penalty_coef": [-0.1, math.nan],
    "kl_estimator": ["k2", None],
    "kl_mode": ["both", None],
    "precalculate_logprobs": [None, 0],
    "logprob_calculation_chunk_size": [0, 8.0],
    "plot_tensors": [1, None],
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
}


def test_every_option_has_wrong_values_in_the_table():
    assert set(BAD_RL_VALUES) == option_names(LocalRLOptions)
    assert set(BAD_SFT_VALUES) == option_names(SFTOptions)


@pytest.mark.parametrize(
    ("call", "name", "value"),
    [("train", n, v) for n, values in BAD_RL_VALUES.items() for v in values]
    + [("train_sft", n, v) for n, values in BAD_SFT_VALUES.items() for v in values],
)
async def test_each_wrong_value_is_a_value_error_naming_the_option(tmp_path, call, name, value):
    # The model is never registered and its base model does not exist: the option is checked
    # before either is looked at (otherwise the error would say "not registered").
    backend = LocalBackend(tmp_path)
    model = TrainableModel(name="m", project="p", base_model=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=rf"\boption {name}=") as caught:
        await getattr(backend, call)(model, [], **{name: value})
    assert "not registered" not in str(caught.value)
    assert not (tmp_path / "p").exists()  # nothing written


def test_constant_reduction_names_the_option_it_needs():
    with pytest.raises(ValueError, match="loss_reduction_constant is needed by"):
        RLConfig(loss_reduction="constant")
    assert (
        RLConfig(loss_reduction="constant", loss_reduction_constant=64.0).loss_reduction_constant
        == 64.0
    )
