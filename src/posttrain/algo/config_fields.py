"""Typed reading and checking of config values for the frozen config dataclasses of `algo`.

A config arrives as a flat mapping (Tinker's `loss_fn_config`, a TOML table): these helpers
reject unknown keys with the nearest valid one, and turn each value into its field's type or
raise a ValueError naming the key and what it accepts.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Collection, Mapping
from typing import TypeVar

ConfigValue = float | str | bool | None
Choice = TypeVar("Choice", bound=str)


def reject_unknown_keys(keys: Collection[str], valid: Collection[str], what: str) -> None:
    """Raise ValueError for the first key not in `valid`, suggesting the nearest valid key."""
    for key in keys:
        if key in valid:
            continue
        close = difflib.get_close_matches(key, list(valid), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown {what} key {key!r}{hint} (valid keys: {', '.join(sorted(valid))})"
        )


def read_number(values: Mapping[str, ConfigValue], key: str, default: float) -> float:
    """values[key] as a float (ints accepted, bools not), or `default` when absent or None."""
    value = values.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key} must be a number, got {value!r}")
    return float(value)


def read_optional_number(
    values: Mapping[str, ConfigValue], key: str, default: float | None
) -> float | None:
    """values[key] as a float, or `default` (possibly None) when absent or None."""
    return default if values.get(key) is None else read_number(values, key, 0.0)


def read_flag(values: Mapping[str, ConfigValue], key: str, default: bool) -> bool:
    """values[key] as a bool, or `default` when absent or None."""
    value = values.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


def read_choice(
    values: Mapping[str, ConfigValue], key: str, choices: tuple[Choice, ...], default: Choice
) -> Choice:
    """values[key] as one of `choices` (a Literal's values), or `default` when absent or None."""
    value = values.get(key)
    if value is None:
        return default
    for choice in choices:
        if choice == value:
            return choice
    raise ValueError(f"{key} must be one of {list(choices)}, got {value!r}")


def check_number(key: str, value: float | None, valid: str, ok: Callable[[float], bool]) -> None:
    """Raise ValueError unless `value` is None or a finite number with ok(value).

    `valid` says in words what ok accepts, for the message.
    """
    if value is None:
        return
    # Typed float, but configs are also built by hand and from untyped data.
    is_number = isinstance(value, int | float) and not isinstance(value, bool)  # pyright: ignore[reportUnnecessaryIsInstance]
    if not (is_number and math.isfinite(value) and ok(value)):
        raise ValueError(f"{key} must be {valid}, got {value!r}")


def check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise ValueError unless `value` is one of `choices`."""
    if value not in choices:
        raise ValueError(f"{key} must be one of {list(choices)}, got {value!r}")
