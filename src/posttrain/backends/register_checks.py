"""What refuses a model at register, before any model loads or service call: a base model that
does not exist, or full fine-tuning on a backend that trains LoRA adapters only."""

from __future__ import annotations

import asyncio

from posttrain.backends.capabilities import Capabilities
from posttrain.backends.model import TrainableModel
from posttrain.backends.preflight import PreflightProblem, backends_with
from posttrain.models.cache import HubUnreachableError, ModelSourceError
from posttrain.models.source import check_base_model


def model_problems(
    backend: str, capabilities: Capabilities, lora_rank: int | None
) -> list[PreflightProblem]:
    """What refuses a model of this `lora_rank` (None or 0, the TOML spelling: full
    fine-tuning) at register, known without the model: for `posttrain explain` and job
    preflight as for register itself."""
    if not lora_rank and not capabilities.supports_full_finetuning:
        having = ", ".join(backends_with("supports_full_finetuning")) or "none installed here"
        return [
            PreflightProblem(
                "lora_rank",
                f"{backend} trains LoRA adapters only (supports_full_finetuning=false): give "
                f"the model a lora_rank (e.g. lora_rank=8; in a job, [model] lora_rank = 8), or "
                f"fine-tune every weight on a backend that can ({having})",
            )
        ]
    return []


async def preflight_register(backend: str, model: TrainableModel) -> None:
    """Raise unless the model's base model is an existing directory or a hub id that is cached
    or that the hub confirms (`models.source`): before any model loads or service call."""
    try:
        await asyncio.to_thread(check_base_model, model.base_model)
    except (FileNotFoundError, HubUnreachableError, ModelSourceError) as exc:
        raise type(exc)(f"{backend} cannot register model {model.name!r}: {exc}") from exc
