"""Plugin backends that declare themselves with retrain's hooks and formats.

`BackendCapabilities` and `BackendOptionSpec` have the fields of retrain 0.3's classes of those
names (retrain itself is not a dependency), so the object formats are tested as retrain writes
them. None of these backends trains: the tests read their declarations.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

RETRAIN_FLAGS = {
    "reports_sync_loss": True,
    "preserves_token_advantages": True,
    "supports_checkpoint_resume": True,
    "resume_runtime_dependent": False,
}


@dataclass(frozen=True)
class BackendCapabilities:
    reports_sync_loss: bool
    preserves_token_advantages: bool
    supports_checkpoint_resume: bool
    resume_runtime_dependent: bool
    supports_echo_shared_forward: bool = False


@dataclass(frozen=True)
class BackendOptionSpec:
    value_type: type
    default: object = None
    choices: tuple[object, ...] | None = None
    validator: Callable[[object], str | None] | None = None


def positive(value: object) -> str | None:
    """A retrain validator: an error message, or None when the value is fine."""
    return None if isinstance(value, int) and value > 0 else "must be > 0"


class RetrainFunctions:
    """Hooks as functions on the class: a dict of the four flags, a mapping of dict specs."""

    def __init__(self, path: str | Path, *, workers: int = 2, mode: str = "fast") -> None:
        self.path, self.workers, self.mode = path, workers, mode

    @staticmethod
    def retrain_backend_capabilities() -> dict[str, bool]:
        return dict(RETRAIN_FLAGS)

    @staticmethod
    def retrain_backend_option_schema() -> dict[str, dict[str, object]]:
        return {
            "workers": {"type": "int", "default": 2, "validator": positive},
            "mode": {"value_type": str, "default": "fast", "choices": ("fast", "safe")},
        }


class RetrainObjects:
    """Hooks as constants holding retrain's objects; the constructor takes **options, so the
    schema is the only list of what `[backend]` may set."""

    RETRAIN_BACKEND_CAPABILITIES = BackendCapabilities(
        reports_sync_loss=False,
        preserves_token_advantages=False,
        supports_checkpoint_resume=True,
        resume_runtime_dependent=True,
        supports_echo_shared_forward=True,
    )
    RETRAIN_BACKEND_OPTION_SCHEMA: Mapping[str, BackendOptionSpec] = {
        "workers": BackendOptionSpec(int, 2, validator=positive),
        "transport": BackendOptionSpec(str, "filesystem", ("filesystem", "zmq")),
    }

    def __init__(self, path: str | Path, **options: object) -> None:
        self.path, self.options = path, options


class BothHooks:
    """posttrain's and retrain's capability hooks disagree; posttrain's wins."""

    @staticmethod
    def posttrain_capabilities() -> dict[str, object]:
        return {
            **RETRAIN_FLAGS,
            "preserves_token_advantages": False,
            "supports_sft": True,
            "supports_kl_reference": False,
            "supports_sampling": True,
            "device_kinds": ["cpu"],
        }

    RETRAIN_BACKEND_CAPABILITIES = RETRAIN_FLAGS  # says it preserves them: loses


class OptionDependent:
    """retrain calls a capability hook with the backend options: this backend carries
    token-level advantages only with `strict = true`. It adds two of posttrain's own flags to
    retrain's four, so a job can sample through it."""

    def __init__(self, path: str | Path, *, strict: bool = True) -> None:
        self.path, self.strict = path, strict

    @staticmethod
    def retrain_backend_capabilities(backend_options: Mapping[str, object]) -> dict[str, object]:
        strict = backend_options.get("strict", True)
        return {**RETRAIN_FLAGS, "preserves_token_advantages": strict, "supports_sampling": True}

    retrain_backend_option_schema = {"strict": {"type": "bool", "default": True}}  # noqa: RUF012

    @staticmethod
    def posttrain_option_schema() -> dict[str, list[dict[str, object]]]:
        def option(name: str, type_: str, default: object) -> dict[str, object]:
            return {
                "name": name,
                "type": type_,
                "default": default,
                "choices": None,
                "description": f"{name} (OptionDependent)",
            }

        return {
            "train": [
                option("learning_rate", "float", 1e-5),
                option("kimi_k2_tau", "float | null", None),
            ]
        }


class MisspeltFlag:
    """A retrain capability dict with a misspelt flag: an error naming the key and the fix."""

    retrain_backend_capabilities = {  # noqa: RUF012
        **{k: v for k, v in RETRAIN_FLAGS.items() if k != "preserves_token_advantages"},
        "preserves_token_advantage": True,
    }
