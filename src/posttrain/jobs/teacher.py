"""The job's `[teacher]` as a `Teacher` (on-policy distillation, docs/distillation.md): a model
loaded in this process, or a run's checkpoint, or a server read through the tinker SDK.

Preflight and `posttrain explain` judge the job with `planned_teacher`, which names the teacher
and loads nothing; `build_teacher` loads it when the job starts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from posttrain.clients.teacher import Teacher
from posttrain.jobs.config import TeacherConfig
from posttrain.jobs.run_dir import resolve_base_model
from posttrain.types import ModelInput

TRAINER_STATE = "trainer_state.json"  # what marks a posttrain checkpoint directory


def teacher_name(config: TeacherConfig) -> str:
    return config.name or config.model or config.model_path or config.base_model or "teacher"


class _NotBuilt:
    """The client of a teacher that preflight judges: it is never asked to score."""

    async def compute_logprobs(self, prompt: ModelInput) -> list[float | None]:
        raise RuntimeError("the job's [teacher] is built when the job starts (build_teacher)")


def planned_teacher(config: TeacherConfig) -> Teacher:
    """The teacher as preflight judges the job's options: named, nothing loaded."""
    return Teacher(_NotBuilt(), name=teacher_name(config))


def is_checkpoint(path: str) -> bool:
    return (Path(path) / TRAINER_STATE).is_file()


def build_teacher(config: TeacherConfig, run_dir: Path, *, seed: int = 0) -> Teacher:
    """Load the teacher (blocking: seconds for a local model). A `tiny:` model is built into
    `run_dir/teacher_model`, as the student's base model is into `run_dir/base_model`."""
    name = teacher_name(config)
    if config.url is not None:
        return _served_teacher(config, name)
    from posttrain.clients.create import create_training_client

    assert config.model is not None
    if is_checkpoint(config.model):
        checkpoint = Path(config.model)
        saved = json.loads((checkpoint / TRAINER_STATE).read_text()).get("model", {})
        base = str(saved.get("base_model", ""))
        if base.startswith("./"):  # relative to the model directory: <model>/checkpoints/<step>
            base = str(checkpoint.parent.parent / base)
        client = create_training_client(
            base,
            lora_rank=saved.get("lora_rank"),
            lora_alpha=saved.get("lora_alpha"),
            train_attn=saved.get("train_attn", True),
            train_mlp=saved.get("train_mlp", True),
            train_unembed=saved.get("train_unembed"),
            dtype=saved.get("dtype", "float32"),
            seed=seed,
        )
        return Teacher(client.create_sampling_client(str(checkpoint)).result(), name=name)
    base = resolve_base_model(config.model, run_dir, into="teacher_model")
    # LoRA of rank 1, its B zero: the base model's logprobs, without full fine-tuning's state.
    return Teacher(create_training_client(base, lora_rank=1, seed=seed), name=name)


def _served_teacher(config: TeacherConfig, name: str) -> Teacher:
    from posttrain.clients.tinker import import_tinker

    tinker = import_tinker()
    api_key = config.api_key or os.environ.get("TINKER_API_KEY")
    service = tinker.ServiceClient(base_url=config.url, api_key=api_key)
    if config.model_path is not None:
        sampling = service.create_sampling_client(model_path=config.model_path)
    else:
        sampling = service.create_sampling_client(base_model=config.base_model)
    tokenizer = None
    if config.tokenizer is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
    return Teacher.from_tinker(sampling, tokenizer=tokenizer, name=name)
