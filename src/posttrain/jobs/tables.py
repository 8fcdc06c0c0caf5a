"""Job tables as values: a table's dataclass built from TOML (its unknown keys named, with the
closest valid one), the secrets a table must not show, and the tiny-model spec."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import fields
from typing import get_args

from posttrain.engine.tiny import Arch, Size, resolve_arch
from posttrain.finder import did_you_mean
from posttrain.trainer.config import DPOConfig, RLConfig, SFTConfig, from_options, option_fields

ARCHES: tuple[str, ...] = get_args(Arch)
SIZES: tuple[str, ...] = get_args(Size)
# A `[backend]` key holds a secret when one of its words (split at `_`, `-`, `.`) is or ends
# with one of these: api_key, apiKey, hf_token, client_secret, password. Not `tokens`, which
# counts tokens (micro_batch_tokens). What is written or shown of it is REDACTED.
SECRET_WORDS = (
    *("key", "keys", "token", "secret", "secrets"),
    *("password", "passwords", "passwd", "credential", "credentials"),
)
REDACTED = "***"


def is_secret(key: str) -> bool:
    """Whether a `[backend]` key names a secret (see SECRET_WORDS)."""
    words = re.split(r"[^a-z0-9]+", key.lower())
    return any(word.endswith(SECRET_WORDS) for word in words)


def redact_secrets(table: Mapping[str, object]) -> dict[str, object]:
    """`table` as it may be written or shown: each secret's value is REDACTED, its key kept so
    one can see it was set (None, not set, stays None)."""
    return {
        key: REDACTED if is_secret(key) and value is not None else value
        for key, value in table.items()
    }


def parse_tiny_spec(spec: str) -> tuple[str, str, int | None]:
    """`tiny:<arch>:<size>[:<seed>]` -> (arch, size, seed or None)."""
    parts = spec.split(":")
    if len(parts) not in (3, 4) or parts[1] not in ARCHES or parts[2] not in SIZES:
        raise ValueError(
            f"[model] base_model={spec!r}: a local tiny model is 'tiny:<arch>:<size>[:<seed>]' "
            f"with arch in {list(ARCHES)} and size in {sorted(SIZES)}, e.g. 'tiny:qwen2:tiny'"
        )
    if len(parts) == 4 and not parts[3].isdigit():
        raise ValueError(f"[model] base_model={spec!r}: the seed after the size must be an integer")
    try:
        resolve_arch(parts[1], parts[2])  # pyright: ignore[reportArgumentType]  # both checked just above
    except ValueError as exc:  # a real size with another architecture
        raise ValueError(f"[model] base_model={spec!r}: {exc}") from None
    return parts[1], parts[2], int(parts[3]) if len(parts) == 4 else None


def build_table(cls: type, table: dict[str, object], name: str) -> object:
    """`cls(**table)`; keys that are not `cls`'s own go to its `trainer` options, if it has one
    (the flat `train()` / `train_sft()` keys, built into the nested config by `from_options`)."""
    own = {f.name for f in fields(cls)} - {"trainer"}
    trainer = next((f for f in fields(cls) if f.name == "trainer"), None)
    trainer_cls = (
        {"sft": SFTConfig, "dpo": DPOConfig, "rl": RLConfig}.get(name) if trainer else None
    )
    passthrough = set(option_fields(trainer_cls)) if trainer_cls else set[str]()
    for key, value in table.items():
        if key not in own and key not in passthrough:
            raise ValueError(f"[{name}] unknown key {key!r}{did_you_mean(key, own | passthrough)}")
        if isinstance(value, dict):
            raise ValueError(f"[{name}] {key} must be a value, got a table")
    kwargs = {k: v for k, v in table.items() if k in own}
    try:
        if trainer_cls is not None:
            options = {k: v for k, v in table.items() if k in passthrough}
            kwargs["trainer"] = from_options(trainer_cls, options)
        return cls(**kwargs)
    except ValueError as exc:
        message = str(exc)
        raise ValueError(message if message.startswith("[") else f"[{name}] {message}") from None
