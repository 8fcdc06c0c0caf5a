"""Both recipes run for 2 steps on the tiny model."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

RECIPES = Path(__file__).parents[2] / "recipes"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, RECIPES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_primitives_recipe_runs(tiny_model_dir):
    rewards = load("rl_primitives").main(
        ["--steps", "2", "--prompts", "2", "--group-size", "4", "--base-model", str(tiny_model_dir)]
    )
    assert len(rewards) == 2 and all(0.0 <= r <= 1.0 and not math.isnan(r) for r in rewards)


async def test_backend_recipe_runs(tiny_model_dir, tmp_path):
    rewards = await load("rl_backend").main(
        ["--steps", "2", "--base-model", str(tiny_model_dir), "--path", str(tmp_path)]
    )
    assert len(rewards) == 2
    assert (tmp_path / "recipes" / "models" / "reverser" / "history.jsonl").exists()
