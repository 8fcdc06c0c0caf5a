"""Typed options: pyright rejects what a backend lacks; the runtime raises TypeError first."""

from __future__ import annotations

import json
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


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"num_minibatches": 0}, "num_minibatches"),
        ({"advantage_balance": 2.0}, "advantage_balance"),
        ({"loss_reduction": "constant"}, "loss_reduction_constant"),
        ({"grad_clip": -1.0}, "grad_clip"),
    ],
)
def test_bad_option_values(options, name):
    with pytest.raises(ValueError, match=name):
        RLConfig(**options)
