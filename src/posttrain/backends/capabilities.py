"""What a backend can do, declared as data and checked by preflight."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, fields, replace

from posttrain.finder import nearest

DEVICE_KINDS = ("cpu", "cuda", "remote")
# retrain's BackendCapabilities: its four flags, and two fields posttrain reads but has no flag for.
RETRAIN_FLAGS = (
    "reports_sync_loss",
    "preserves_token_advantages",
    "supports_checkpoint_resume",
    "resume_runtime_dependent",
)
RETRAIN_ONLY = ("checkpoint_resume_mode", "supports_echo_shared_forward")
RESUME_MODES = ("unsupported", "adapter_only", "exact")


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
    # Its sampler can return each sampled token's Shannon entropy (TokenSegment.entropies),
    # which uncertainty_kind='shannon_entropy' reads. Optional in a plugin's dict: a flag added
    # after the others, so a plugin written before it keeps working (conservatively False).
    provides_token_entropies: bool = False
    # Its models can get a value model beside the policy, trained with it: PPO with a learned
    # critic (advantage_estimator='gae'). Optional for plugins, like provides_token_entropies.
    supports_critic: bool = False
    # It trains every weight of a model registered with lora_rank=None (or 0). Optional for plugins and
    # True there: a plugin that cannot says so at register, as TinkerBackend does.
    supports_full_finetuning: bool = True

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
        required = {f.name for f in fields(cls) if f.default is MISSING}
        unknown = sorted(set(values) - known)
        missing = sorted(required - set(values))
        if unknown or missing:
            found = [f"unknown keys {unknown}"] if unknown else []
            found += [f"missing keys {missing}"] if missing else []
            hint = (
                " (a plugin that knows only retrain's four flags can declare them through "
                "retrain_backend_capabilities and get conservative values for the rest)"
                if missing and not unknown
                else ""
            )
            raise ValueError(
                f"{source} returned malformed capabilities: {', '.join(found)}; "
                f"expected exactly {sorted(required)}, optionally {sorted(known - required)}{hint}"
            )
        data = dict(values)
        kinds = data.get("device_kinds")
        data["device_kinds"] = tuple(kinds) if isinstance(kinds, list | tuple) else kinds
        try:
            return cls(**data)  # pyright: ignore[reportArgumentType]
        except ValueError as exc:
            raise ValueError(f"{source} returned malformed capabilities: {exc}") from None

    @classmethod
    def from_retrain(cls, values: object, source: str) -> Capabilities:
        """Build from retrain's formats: a dict of its four flags, or its `BackendCapabilities`
        (any object with the four flags as attributes). posttrain's other flags may be given
        too; those left out take their CONSERVATIVE value. Errors name `source`, the key and
        the fix."""
        expected = (
            f"return a dict with retrain's four flags {list(RETRAIN_FLAGS)} (posttrain's own "
            "flags may be added) or a BackendCapabilities"
        )
        posttrain_flags = [f.name for f in fields(cls)]
        if isinstance(values, Mapping):
            data = {str(k): v for k, v in values.items()}
        else:
            names = [*RETRAIN_FLAGS, *RETRAIN_ONLY, *posttrain_flags]
            data = {n: getattr(values, n) for n in names if hasattr(values, n)}
        known = sorted({*posttrain_flags, *RETRAIN_ONLY})
        for key in sorted(set(data) - set(known)):
            close = nearest(key, known)
            hint = f" (did you mean {close!r}?)" if close else ""
            raise ValueError(f"{source} returned an unknown capability {key!r}{hint}; {expected}")
        missing = [k for k in RETRAIN_FLAGS if k not in data]
        if missing:
            what = "capabilities" if isinstance(values, Mapping) else type(values).__name__
            raise ValueError(f"{source} returned {what} without {missing}; {expected}")
        mode = data.pop("checkpoint_resume_mode", "exact")
        if mode not in RESUME_MODES:
            raise ValueError(
                f"{source} returned checkpoint_resume_mode={mode!r}; use one of {list(RESUME_MODES)}"
            )
        data.pop("supports_echo_shared_forward", None)  # a retrain engine detail, no posttrain use
        if mode != "exact" and data["supports_checkpoint_resume"] is True:
            # posttrain's flag promises weights, optimizer and RNG back exactly; retrain's
            # "adapter_only" resume brings back the weights alone.
            data["supports_checkpoint_resume"] = False
        kinds = data.get("device_kinds", CONSERVATIVE.device_kinds)
        if isinstance(kinds, list):
            data["device_kinds"] = tuple(kinds)
        try:
            return replace(CONSERVATIVE, **data)
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
    provides_token_entropies=True,  # engine.decode.sampler computes them per decode step
    supports_critic=True,
)
