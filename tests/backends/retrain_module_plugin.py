"""A plugin whose retrain hooks live on its module, next to a factory function, with both of
retrain's names given: retrain reads the lowercase name on the factory, then on the module,
then the uppercase one, so the module's `retrain_backend_capabilities` beats the factory's
`RETRAIN_BACKEND_CAPABILITIES`."""

from __future__ import annotations

from pathlib import Path


class Remote:
    def __init__(self, path: str | Path, options: dict[str, object]) -> None:
        self.path, self.options = path, options


def make_backend(path: str | Path = ".posttrain", **options: object) -> Remote:
    return Remote(path, options)


make_backend.RETRAIN_BACKEND_CAPABILITIES = {  # pyright: ignore[reportFunctionMemberAccess]
    "reports_sync_loss": False,
    "preserves_token_advantages": False,
    "supports_checkpoint_resume": False,
    "resume_runtime_dependent": True,
}

retrain_backend_capabilities = {
    "reports_sync_loss": True,
    "preserves_token_advantages": True,
    "supports_checkpoint_resume": True,
    "resume_runtime_dependent": True,
    "checkpoint_resume_mode": "adapter_only",  # retrain HEAD: weights only, not exact
    "device_kinds": ["remote"],
}


def RETRAIN_BACKEND_OPTION_SCHEMA() -> dict[str, dict[str, object]]:  # retrain names it so
    return {"endpoint": {"type": str, "default": "http://127.0.0.1:8000"}}
