"""Option schemas, derived from the typed option definitions (one source of truth).

`option_schema` reads a backend's `train()` / `train_sft()` TypedDict: the type and choices from
the annotation, the default and the description from the option's field in the matching config
dataclass (`trainer.config`, where each option is defined once), or `Annotated[..., "text"]`
metadata on the TypedDict's field, else `backends.options.HELP`. An option with no description
is an error, so the listing can never show an undocumented option.
`constructor_schema` describes the keyword arguments a backend's constructor takes (what a job
config's `[backend]` table may set); `backends.plugins.backend_options` adds what a plugin declares
about them.
"""

from __future__ import annotations

import inspect
import keyword
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import TYPE_CHECKING, Annotated, Literal, Union, get_args, get_origin, get_type_hints

from posttrain.backends.options import HELP, option_names
from posttrain.trainer.config import option_defaults, option_help

if TYPE_CHECKING:
    from posttrain.backends.plugins.backend_options import BackendOption

JSONScalar = str | int | float | bool | None
OPTION_KEYS = ("name", "type", "default", "choices", "description")


@dataclass(frozen=True)
class OptionSchema:
    """One option: name, type, default, choices (for Literal types) and description."""

    name: str
    type: str
    default: JSONScalar
    choices: tuple[JSONScalar, ...] | None
    description: str

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "type": self.type,
            "default": self.default,
            "choices": list(self.choices) if self.choices is not None else None,
            "description": self.description,
        }

    @classmethod
    def from_mapping(cls, row: object, source: str) -> OptionSchema:
        """Build from a plugin hook's dict; anything malformed is a ValueError naming `source`."""
        if not isinstance(row, Mapping) or set(row) != set(OPTION_KEYS):
            keys = sorted(row) if isinstance(row, Mapping) else type(row).__name__
            raise ValueError(
                f"{source}: each option must be a dict with keys {list(OPTION_KEYS)}, got {keys}"
            )
        name, type_, default, choices, description = (row[k] for k in OPTION_KEYS)
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
            raise ValueError(f"{source}: option name {name!r} is not a valid keyword argument name")
        if not isinstance(type_, str) or not type_:
            raise ValueError(f"{source}: option {name!r} needs its type as a string, got {type_!r}")
        if not isinstance(description, str) or not description.strip():
            raise ValueError(f"{source}: option {name!r} needs a description (a non-empty string)")
        if not is_scalar(default):
            raise ValueError(f"{source}: option {name!r} default {default!r} is not a JSON scalar")
        if choices is not None:
            if not isinstance(choices, list | tuple) or not all(is_scalar(c) for c in choices):
                raise ValueError(
                    f"{source}: option {name!r} choices must be a list of scalars or null"
                )
            if default is not None and default not in choices:
                raise ValueError(
                    f"{source}: option {name!r} default {default!r} is not one of its choices"
                )
            choices = tuple(choices)
        return cls(name, type_, default, choices, description)


@dataclass(frozen=True)
class ParameterSchema:
    """One keyword argument of a backend's constructor; `**name` stands for `**kwargs`.
    `option` is set when a plugin's option schema declares it (choices, validator)."""

    name: str
    type: str
    default: JSONScalar
    required: bool
    option: BackendOption | None = None

    def as_dict(self) -> dict[str, object]:
        choices = self.option.choices if self.option is not None else None
        return {
            "name": self.name,
            "type": self.type,
            "default": self.default,
            "required": self.required,
            "choices": list(choices) if choices is not None else None,
            "has_validator": self.option is not None and self.option.validator is not None,
        }


def is_scalar(value: object) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def type_name(annotation: object) -> str:
    origin = get_origin(annotation)
    if origin is Literal:
        values = get_args(annotation)
        return "str" if all(isinstance(v, str) for v in values) else "literal"
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in get_args(annotation))
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def choices_of(annotation: object) -> tuple[JSONScalar, ...] | None:
    origin = get_origin(annotation)
    if origin is Literal:
        return get_args(annotation)
    if origin in (Union, types.UnionType):
        for arg in get_args(annotation):
            if (found := choices_of(arg)) is not None:
                return found
    return None


def description_of(
    options_type: type, name: str, annotation: object, described: Mapping[str, str]
) -> str:
    """The field's `Annotated` string metadata, else the config field's help (`described`),
    else HELP[name]; missing is an error."""
    if get_origin(annotation) is Annotated:
        texts = [m for m in annotation.__metadata__ if isinstance(m, str)]  # pyright: ignore[reportAttributeAccessIssue]
        if texts:
            return texts[0]
    if name in described:
        return described[name]
    if name in HELP:
        return HELP[name]
    raise ValueError(
        f"option {name!r} of {options_type.__name__} has no description: give its config field "
        f"a help line (posttrain.algo.config_fields.option) or annotate it as "
        f"Annotated[<type>, 'what it does']"
    )


def option_schema(options_type: type, config_type: type) -> list[OptionSchema]:
    """Schemas of the options a TypedDict declares, with defaults from its config dataclass."""
    hints = get_type_hints(options_type)
    extras = get_type_hints(options_type, include_extras=True)
    defaults = option_defaults(config_type)
    described = option_help(config_type)
    return [
        OptionSchema(
            name=name,
            type=type_name(hints[name]),
            default=defaults.get(name),  # pyright: ignore[reportArgumentType]  # a plugin option may have no default
            choices=choices_of(hints[name]),
            description=description_of(options_type, name, extras[name], described),
        )
        for name in sorted(option_names(options_type))
    ]


def constructor_hints(factory: Callable[..., object]) -> dict[str, object]:
    """The resolved annotations of `factory`'s parameters ({} when they cannot be resolved)."""
    target = factory.__init__ if isinstance(factory, type) else factory
    try:
        return get_type_hints(target)
    except Exception:  # names only imported under TYPE_CHECKING: fall back to no types
        return {}


def constructor_parameters(factory: Callable[..., object]) -> dict[str, inspect.Parameter]:
    """`factory`'s parameters without `self` and `*args` (those a config table could set)."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cannot read the signature of {factory!r}: {exc}") from None
    return {name: p for name, p in signature.parameters.items() if p.kind != p.VAR_POSITIONAL}


def constructor_schema(factory: Callable[..., object]) -> list[ParameterSchema]:
    hints = constructor_hints(factory)
    out: list[ParameterSchema] = []
    for name, p in constructor_parameters(factory).items():
        if p.kind == p.VAR_KEYWORD:
            out.append(ParameterSchema(f"**{name}", "any", None, False))
            continue
        annotation = hints.get(name, p.annotation)
        type_ = "any" if annotation is inspect.Parameter.empty else type_name(annotation)
        default = p.default
        if isinstance(default, PurePath):
            default = str(default)
        required = default is inspect.Parameter.empty
        if required:
            default = None
        elif not is_scalar(default):
            default = repr(default)
        out.append(ParameterSchema(name, type_, default, required))
    return out
