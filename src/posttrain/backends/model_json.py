"""`model.json`: the settings of the model a directory holds, so another model never reuses it.

Every backend writes it beside the model's checkpoints at registration, and refuses a directory
whose `model.json` names another base model or LoRA rank.
"""

from __future__ import annotations

import json
from pathlib import Path

from posttrain.backends.model import TrainableModel

# model.json keys that must match to reuse a model directory.
IDENTITY_KEYS = ("base_model", "lora_rank")


def check_model_json(directory: Path, model: TrainableModel) -> None:
    """Refuse a directory that already holds a different model (another base or LoRA rank)."""
    path = directory / "model.json"
    if not path.exists():
        return
    saved = json.loads(path.read_text())
    config = model_record(directory, model)
    missing = [key for key in IDENTITY_KEYS if key not in saved]
    if missing:
        raise ValueError(f"{path} has no {', '.join(missing)}: it is not a posttrain model.json")
    # A model.json written before base models inside the directory were stored relative.
    saved = {**saved, "base_model": portable_base_model(str(saved["base_model"]), directory)}
    if any(saved[key] != config[key] for key in IDENTITY_KEYS):
        raise ValueError(
            f"{directory} already holds model {model.name!r} with base_model="
            f"{saved['base_model']!r}, lora_rank={saved['lora_rank']!r}; use another "
            "name or the same settings"
        )


def write_model_json(directory: Path, model: TrainableModel) -> None:
    """Check (as `check_model_json`), then write the model's settings to `model.json`."""
    check_model_json(directory, model)
    directory.mkdir(parents=True, exist_ok=True)
    record = model_record(directory, model)
    (directory / "model.json").write_text(json.dumps(record, indent=2) + "\n")


def model_record(directory: Path, model: TrainableModel) -> dict[str, object]:
    """The model's settings as written under `directory` (model.json, checkpoints): a base
    model inside the directory is named relative to it, so the directory can be moved or
    copied and resumed elsewhere."""
    return {**model.config_dict(), "base_model": portable_base_model(model.base_model, directory)}


def portable_base_model(base_model: str, directory: Path) -> str:
    """`./<path>` for a base model directory inside `directory`; any other value as it is."""
    path = Path(base_model)
    if base_model.startswith("./") or not path.exists():  # relative already, or a hub id
        return base_model
    try:
        inside = path.resolve().relative_to(directory.resolve())
    except ValueError:
        return base_model
    return f"./{inside.as_posix()}"
