"""A job's RL steps print no warning: sampling, shared-prefix training and LoRA on the current
transformers and PEFT APIs (transformers 5.24 warned at every decode step and every
shared-prefix pass that `past_key_values` is deprecated)."""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from posttrain.engine import shared_prefix
from posttrain.jobs.config import parse_config
from posttrain.jobs.train_job import run_job
from posttrain.tasks.protocol import Problem
from posttrain.tasks.reverse import ReverseTask
from posttrain.types import StopReason


@dataclass(frozen=True)
class DistinctLetters(ReverseTask):
    """`reverse`'s prompts, rewarded by the distinct characters of any completion: a random
    model's samples then differ in reward, so every group trains."""

    def reward(self, problem: Problem, completion: str, stop_reason: StopReason) -> float:
        return len(set(completion)) / 8


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
async def test_rl_steps_warn_nothing(
    tied: bool, tied_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also on a tied model adapting its shared matrix, which PEFT warns about unless the
    adapter ties it (`ensure_weight_tying`, as posttrain's does)."""
    model = {"base_model": str(tied_model_dir), "train_unembed": True} if tied else {}
    config = parse_config(
        {
            "run": {
                "task": f"{__name__}:DistinctLetters",
                "name": "w",
                "project": "p",
                "output_dir": str(tmp_path),
            },
            "model": {"base_model": "tiny:qwen2:tiny", "lora_rank": 4, **model},
            "rl": {"steps": 2, "prompts_per_step": 2, "group_size": 4, "max_tokens": 6},
            "eval": {"held_out": 2, "every": 2},
        }
    )
    shared_passes: list[int] = []
    real_pass = shared_prefix._shared_pass

    def counting_pass(*args, **kwargs):
        shared_passes.append(1)
        return real_pass(*args, **kwargs)

    monkeypatch.setattr(shared_prefix, "_shared_pass", counting_pass)
    # transformers' logger says some things once per process (`warning_once`, an lru_cache):
    # forget what it said before this test, so that nothing said here goes unseen.
    logging.Logger.warning_once.cache_clear()  # pyright: ignore[reportAttributeAccessIssue]
    records = Records()
    logger = logging.getLogger("transformers")
    logger.addHandler(records)
    try:
        # Every warning recorded, whatever pyproject's filterwarnings ignores (FutureWarning,
        # the category of transformers' deprecations, among them).
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            await run_job(config, echo=lambda _: None)
    finally:
        logger.removeHandler(records)
    assert shared_passes, "the RL steps ran no shared-prefix pass"
    shown = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught]
    assert shown == []
    assert records.messages == []
