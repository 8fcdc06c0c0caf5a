"""What a backend can do, declared as data and checked by preflight."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

DEVICE_KINDS = ("cpu", "cuda", "remote")


@dataclass(frozen=True)
class Capabilities:
    """Flags a backend declares; `posttrain backends` prints them and preflight checks them."""

    reports_sync_loss: bool  # the loss it reports is the one its gradient came from
    preserves_token_advantages: bool  # per-token advantages reach the loss unchanged
    supports_checkpoint_resume: bool  # weights, optimizer, RNG and run state come back exactly
    resume_runtime_dependent: bool  # resuming needs the same runtime (service, cluster)
    supports_sft: bool
    supports_kl_reference: bool  # can score tokens under the base model for KL penalties
    supports_sampling: bool
    device_kinds: tuple[str, ...]

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "device_kinds":
                if not isinstance(value, tuple) or any(k not in DEVICE_KINDS for k in value):
                    raise ValueError(
                        f"capabilities.device_kinds must be a tuple of {DEVICE_KINDS}, got {value!r}"
                    )
            elif not isinstance(value, bool):
                raise ValueError(f"capabilities.{f.name} must be true or false, got {value!r}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, object], source: str) -> Capabilities:
        """Build from a plugin hook's dict; unknown or missing keys are errors naming `source`."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        missing = sorted(known - set(values))
        if unknown or missing:
            found = [f"unknown keys {unknown}"] if unknown else []
            found += [f"missing keys {missing}"] if missing else []
            raise ValueError(
                f"{source} returned malformed capabilities: {', '.join(found)}; "
                f"expected exactly {sorted(known)}"
            )
        data = dict(values)
        kinds = data.get("device_kinds")
        data["device_kinds"] = tuple(kinds) if isinstance(kinds, list | tuple) else kinds
        try:
            return cls(**data)  # type: ignore[arg-type]
        except ValueError as exc:
            raise ValueError(f"{source} returned malformed capabilities: {exc}") from None

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["device_kinds"] = list(self.device_kinds)
        return out


# What a plugin without hooks gets: nothing is assumed that could silently degrade training.
CONSERVATIVE = Capabilities(
    reports_sync_loss=False,
    preserves_token_advantages=False,
    supports_checkpoint_resume=False,
    resume_runtime_dependent=True,
    supports_sft=False,
    supports_kl_reference=False,
    supports_sampling=False,
    device_kinds=(),
)

LOCAL = Capabilities(
    reports_sync_loss=True,
    preserves_token_advantages=True,
    supports_checkpoint_resume=True,
    resume_runtime_dependent=False,
    supports_sft=True,
    supports_kl_reference=True,
    supports_sampling=True,
    device_kinds=("cpu", "cuda"),
)
