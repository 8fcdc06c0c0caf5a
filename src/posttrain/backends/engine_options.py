"""A backend's `inference=` argument: the engine config, and where that puts training."""

from __future__ import annotations

from collections.abc import Mapping

from posttrain.engine.devices import AUTO
from posttrain.inference.config import InferenceConfig


def engine_config(
    value: InferenceConfig | Mapping[str, object] | None, backend: str
) -> InferenceConfig:
    """`inference=` as an InferenceConfig (a dict's keys are its fields)."""
    if value is None:
        return InferenceConfig()
    if isinstance(value, InferenceConfig):
        return value
    return InferenceConfig.from_mapping(value, f"{backend} inference")


def trainer_device(device: str, inference: InferenceConfig, backend: str) -> str:
    """The training device: `device`, or the last of `inference.devices` when split. Both
    given and different is an error naming the two."""
    split = inference.split_devices()
    if split is None:
        return device
    if device not in (AUTO, split[1]):
        raise ValueError(
            f"{backend}(device={device!r}) and inference devices={inference.devices!r} (trainer "
            f"on {split[1]!r}) disagree; set one of them"
        )
    return split[1]
