"""Checks on values that cross into posttrain from outside the type system: user code, JSON,
numpy scalars.

Each takes `object`. A value's annotation is what its caller promised, not yet what it holds,
so an isinstance test on the annotated value reads to pyright as always true; passing it here
states that the check is at a boundary. The callers keep their own error messages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import UnionType
from typing import TypeGuard, TypeVar

import numpy as np

T = TypeVar("T")


def is_integer(value: object) -> bool:
    """An int or numpy integer, never a bool (an int subclass that is never a count or an id)."""
    return not isinstance(value, bool) and isinstance(value, int | np.integer)


def is_number(value: object) -> bool:
    """An int, float or numpy number (NaN and inf included), never a bool."""
    return not isinstance(value, bool) and isinstance(value, int | float | np.number)


def is_name(value: object) -> bool:
    """A non-empty string."""
    return isinstance(value, str) and value != ""


def is_sequence(value: object) -> TypeGuard[Sequence[object]]:
    """A list, tuple or other sequence, but not a str or bytes (sequences of characters)."""
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


def is_mapping(value: object) -> TypeGuard[Mapping[object, object]]:
    """A dict or other mapping, its keys and values not yet known."""
    return isinstance(value, Mapping)


def is_instance(value: object, kind: type | UnionType) -> bool:
    """isinstance for a value whose annotation already says `kind`, checked because callers
    outside the type system (untyped code, JSON) reach it too."""
    return isinstance(value, kind)


def expect(value: object, kind: type[T], what: str) -> T:
    """`value`, checked to be a `kind` (a container's items are not checked): for what a file
    or another process hands back; TypeError naming `what` otherwise."""
    if not isinstance(value, kind):
        raise TypeError(f"{what} must be a {kind.__name__}, got {type(value).__name__}")
    return value
