"""Example plugin backends for the registry tests: one with hooks, one without, one broken."""

from __future__ import annotations


class HookedBackend:
    """A remote-style backend that declares what it can do through hooks."""

    @staticmethod
    def posttrain_capabilities() -> dict[str, object]:
        return {
            "reports_sync_loss": True,
            "preserves_token_advantages": False,
            "supports_checkpoint_resume": True,
            "resume_runtime_dependent": True,
            "supports_sft": True,
            "supports_kl_reference": False,
            "supports_sampling": True,
            "device_kinds": ["remote"],
        }

    @staticmethod
    def posttrain_option_schema() -> dict[str, list[dict[str, object]]]:
        return {
            "train": [
                {"name": "learning_rate", "type": "float", "default": 1e-5, "choices": None, "description": "lr"}
            ]
        }


class PlainBackend:
    """No hooks at all: conservative capabilities."""


class BrokenBackend:
    @staticmethod
    def posttrain_capabilities() -> dict[str, object]:
        return {"reports_sync_loss": "yes"}
