"""Option schemas, derived from the typed option definitions (one source of truth)."""

from __future__ import annotations

import types
from dataclasses import MISSING, dataclass, fields
from typing import Literal, Union, get_args, get_origin, get_type_hints

from posttrain.backends.options import HELP, option_names

JSONScalar = str | int | float | bool | None


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


def option_schema(options_type: type, config_type: type) -> list[OptionSchema]:
    """Schemas of the options a TypedDict declares, with defaults from its config dataclass."""
    hints = get_type_hints(options_type)
    defaults = {f.name: f.default for f in fields(config_type) if f.default is not MISSING}
    return [
        OptionSchema(
            name=name,
            type=type_name(hints[name]),
            default=defaults.get(name),  # type: ignore[arg-type]
            choices=choices_of(hints[name]),
            description=HELP.get(name, ""),
        )
        for name in sorted(option_names(options_type))
    ]
