"""Config fields that are `train()` / `train_sft()` options: one definition each, and their checks.

An option is one field of a frozen config dataclass, written once with `option(default, help,
check)`: its default, its one line of help and its range. A config nests groups of options by
concern (`group(...)`); its flat view (`option_fields`) maps each option's key (the field's name,
or `key=` where the two differ) to the field, so the flat keyword options of `train()` build
(`from_options`), list (`option_values`, `option_defaults`) and describe (`option_help`) the
nested config without a second copy of any option. A config's `__post_init__` calls
`check_fields`: each option's type (Literal choices included) and range, checked in one place.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable, Collection, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass, replace
from typing import Any, Literal, TypeVar, Union, cast, get_args, get_origin, get_type_hints

from posttrain.finder import did_you_mean

ConfigValue = float | str | bool | None
T = TypeVar("T")
C = TypeVar("C")

HELP, CHECK, KEY, APPLIES_TO, GROUP = "help", "check", "key", "applies_to", "group"


@dataclass(frozen=True)
class Check:
    """A range: `ok(value)` must hold for every value but None; `expected` says it in words.

    `ok` is False for NaN whatever the bound, since every comparison with NaN is.
    """

    expected: str
    ok: Callable[[float], bool]


NON_NEGATIVE = Check("a finite number >= 0", lambda v: 0 <= v < math.inf)
POSITIVE = Check("a finite number > 0", lambda v: 0 < v < math.inf)
AT_LEAST_ONE = Check(">= 1", lambda v: v >= 1)


def option(
    default: T,
    help: str,
    check: Check | None = None,
    *,
    key: str | None = None,
    applies_to: tuple[str, ...] | None = None,
) -> T:
    """A config field that is an option: its default, help line, range, and flat key when that
    is not the field's name. `applies_to` names the losses that read it (None: all of them)."""
    metadata = {HELP: help, CHECK: check, KEY: key, APPLIES_TO: applies_to}
    return field(default=default, metadata=metadata)


def group(factory: Callable[[], T]) -> T:
    """A config field that holds a group of options (a frozen config dataclass)."""
    return field(default_factory=factory, metadata={GROUP: True})


def key_of(config_field: Field[Any]) -> str:
    """The flat option key of a field: its name unless its metadata names another."""
    return config_field.metadata.get(KEY) or config_field.name


@dataclass(frozen=True)
class OptionField:
    """One option of a config type: its flat key and where it sits in the nested config."""

    key: str
    path: tuple[str, ...]  # attribute names from the root config to the option
    field: Field[Any]
    annotation: object

    @property
    def help(self) -> str | None:
        return self.field.metadata.get(HELP)


def _is_group(config_field: Field[Any]) -> bool:
    return bool(config_field.metadata.get(GROUP))


@functools.cache
def _hints(config_type: type) -> dict[str, object]:
    return get_type_hints(config_type)


def _annotations(config_type: type) -> dict[str, object]:
    """Resolved annotations, or {} for a (plugin's) config whose names do not resolve here."""
    try:
        return _hints(config_type)
    except Exception:  # names imported only under TYPE_CHECKING
        return {}


@functools.cache
def option_fields(config_type: type) -> Mapping[str, OptionField]:
    """The options of a config dataclass by flat key, in field order, through its groups
    (read-only: it is computed once per type).

    Two options with one key are a TypeError: the flat view must name each field once.
    """
    out: dict[str, OptionField] = {}
    hints = _annotations(config_type)
    for config_field in fields(config_type):
        annotation = hints.get(config_field.name, config_field.type)
        if _is_group(config_field):
            inner = option_fields(_group_type(config_field))
            found = {k: replace(f, path=(config_field.name, *f.path)) for k, f in inner.items()}
        else:
            key = key_of(config_field)
            found = {key: OptionField(key, (config_field.name,), config_field, annotation)}
        for key in found:
            if key in out:
                raise TypeError(f"{config_type.__name__} has two options named {key!r}")
        out.update(found)
    return types.MappingProxyType(out)


def _group_default(config_field: Field[Any]) -> object:
    factory = config_field.default_factory
    if factory is MISSING:
        raise TypeError(f"group {config_field.name!r} needs a default (use `group(...)`)")
    return factory()


def _group_type(config_field: Field[Any]) -> type:
    return type(_group_default(config_field))


def _get(config: object, path: tuple[str, ...]) -> object:
    for name in path:
        config = getattr(config, name)
    return config


def option_values(config: object) -> dict[str, object]:
    """The flat options of a config instance: key -> value."""
    return {key: _get(config, f.path) for key, f in option_fields(type(config)).items()}


def option_defaults(config_type: type) -> dict[str, object]:
    """The default of each option that has one (a group's are those of its default value)."""
    out: dict[str, object] = {}
    for config_field in fields(config_type):
        if _is_group(config_field):
            out.update(option_values(_group_default(config_field)))
        elif config_field.default is not MISSING:
            out[key_of(config_field)] = config_field.default
        elif config_field.default_factory is not MISSING:
            out[key_of(config_field)] = config_field.default_factory()
    return out


def option_help(config_type: type) -> dict[str, str]:
    """The help line of each option that has one: key -> text."""
    found = option_fields(config_type).items()
    return {key: f.help for key, f in found if f.help is not None}


def from_options(config_type: type[C], options: Mapping[str, object]) -> C:
    """The nested config of flat `options`; a group not named keeps its default value.

    An unknown key is a TypeError naming the nearest known one; a bad value is the ValueError
    of the field's own check. A config whose aliases conflict in ways its fields cannot show
    (an explicit value equal to the default) checks the given keys in `check_given(options)`.
    """
    check_given(config_type, options)
    return cast(C, _build(config_type, options, None))


def check_given(config_type: type, options: Mapping[str, object]) -> None:
    """Unknown keys (a TypeError naming the nearest), then the config's own `check_given`."""
    known = option_fields(config_type)
    for key in options:
        if key not in known:
            hint = did_you_mean(key, known)
            raise TypeError(f"{config_type.__name__} has no option {key!r}{hint}")
    own: Callable[[Mapping[str, object]], None] | None = getattr(config_type, "check_given", None)
    if own is not None:
        own(options)


def _build(config_type: type, options: Mapping[str, object], base: object | None) -> object:
    """`config_type` with `options`, its other fields as in `base` (None: their defaults)."""
    changes: dict[str, object] = {}
    if base is not None:
        changes = {f.name: getattr(base, f.name) for f in fields(config_type) if f.init}
    for config_field in fields(config_type):
        if _is_group(config_field):
            group_type = _group_type(config_field)
            inner = {k: v for k, v in options.items() if k in option_fields(group_type)}
            if inner:
                current: object = (
                    getattr(base, config_field.name)
                    if base is not None
                    else _group_default(config_field)
                )
                changes[config_field.name] = _build(group_type, inner, current)
        elif key_of(config_field) in options:
            changes[config_field.name] = options[key_of(config_field)]
    return config_type(**changes)


def with_options(config: C, **changes: object) -> C:
    """`config` with some flat options changed (checked as when built; every key of an existing
    config is given, so only the changes are checked as given)."""
    config_type = type(config)
    check_given(config_type, changes)
    return cast(C, _build(config_type, {**option_values(config), **changes}, None))


def check_fields(config: object) -> None:
    """Check each field of a config dataclass against its annotation and its option's range;
    an int given for a float field becomes that float (as TOML and JSON numbers arrive)."""
    config_type: type = type(config)
    hints = _hints(config_type)
    for config_field in fields(config_type):
        name, value = key_of(config_field), getattr(config, config_field.name)
        annotation = hints[config_field.name]
        check_value(name, annotation, value)
        if _takes_float(annotation) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
            object.__setattr__(config, config_field.name, value)
        check: Check | None = config_field.metadata.get(CHECK)
        if check is not None and value is not None and not check.ok(value):
            raise ValueError(f"option {name}={value!r} is invalid: expected {check.expected}")


def check_field_types(config: object) -> None:
    """Runtime check of each field against its annotation (Literal choices included)."""
    for name, annotation in _hints(type(config)).items():
        check_value(name, annotation, getattr(config, name))


def check_value(name: str, annotation: object, value: object) -> None:
    """Raise ValueError unless `value` fits `annotation` (Literal choices included); a string
    that is not one of the choices names the nearest one."""
    if not _accepts(annotation, value):
        hint = did_you_mean(value, _string_choices(annotation)) if isinstance(value, str) else ""
        raise ValueError(
            f"option {name}={value!r} is invalid: expected {_describe(annotation)}{hint}"
        )


def _string_choices(annotation: object) -> list[str]:
    origin = get_origin(annotation)
    if origin is Literal:
        return [a for a in get_args(annotation) if isinstance(a, str)]
    if origin in (Union, types.UnionType):
        return [c for a in get_args(annotation) for c in _string_choices(a)]
    return []


def _takes_float(annotation: object) -> bool:
    if get_origin(annotation) in (Union, types.UnionType):
        return float in get_args(annotation)
    return annotation is float


def _accepts(annotation: object, value: object) -> bool:
    origin = get_origin(annotation)
    if origin is Literal:
        return value in get_args(annotation)
    if origin in (Union, types.UnionType):
        return any(_accepts(arg, value) for arg in get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True


def _describe(annotation: object) -> str:
    origin = get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(annotation))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(annotation))
    return str(getattr(annotation, "__name__", annotation))


def is_config(value: object) -> bool:
    """Whether `value` is a config dataclass instance whose fields are options or groups."""
    if not is_dataclass(value) or isinstance(value, type):
        return False
    return any(HELP in f.metadata or _is_group(f) for f in fields(value))


def reject_unknown_keys(keys: Collection[str], valid: Collection[str], what: str) -> None:
    """Raise ValueError for the first key not in `valid`, suggesting the nearest valid key."""
    for key in keys:
        if key in valid:
            continue
        raise ValueError(
            f"unknown {what} key {key!r}{did_you_mean(key, valid)} "
            f"(valid keys: {', '.join(sorted(valid))})"
        )


def read_optional_number(values: Mapping[str, ConfigValue], key: str) -> float | None:
    """values[key] as a float (ints accepted, bools not), or None when absent or None."""
    value = values.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key} must be a number, got {value!r}")
    return float(value)
