"""`[backend]` options a plugin declares in retrain's option-schema format: a mapping
name -> `{type|value_type, default, choices?, validator?}` (or retrain's `BackendOptionSpec`).

retrain's backend options are what posttrain's `[backend]` table holds, the constructor's
keyword arguments: `with_backend_options` merges the declared ones into the constructor's
description, and the job checks each value and passes each default the table leaves out.
"""

from __future__ import annotations

import keyword
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from posttrain.backends.plugins.schema import JSONScalar, ParameterSchema, is_scalar
from posttrain.finder import nearest

Validator = Callable[[object], object]  # retrain's: returns an error message, or None when fine
# retrain's option-schema entry: {type|value_type, default, choices?, validator?}; type names
# as retrain reads them (a Python type works too).
RETRAIN_SPEC_KEYS = ("type", "value_type", "default", "choices", "validator")
VALUE_TYPES: dict[str, type] = {
    "bool": bool,
    "boolean": bool,
    "int": int,
    "integer": int,
    "float": float,
    "str": str,
    "string": str,
}


@dataclass(frozen=True)
class BackendOption:
    """One `[backend]` key as a plugin's option schema declares it (retrain's format)."""

    name: str
    value_type: type
    default: JSONScalar
    choices: tuple[JSONScalar, ...] | None
    validator: Validator | None = field(compare=False)
    declared_by: str  # the hook, for messages

    def problem(self, value: object) -> str | None:
        """Why `value` cannot be this option's value, or None."""
        if not _is_a(value, self.value_type):
            return f"expected {self.value_type.__name__}, got {type(value).__name__}"
        if self.choices is not None and value not in self.choices:
            return f"must be one of {list(self.choices)}"
        if self.validator is None:
            return None
        try:
            message = self.validator(value)
        except Exception as exc:  # plugin code: report what it raised
            return f"its validator raised {type(exc).__name__}: {exc}"
        return str(message) if message else None

    @classmethod
    def from_retrain(cls, name: object, spec: object, source: str) -> BackendOption:
        """Read one entry of retrain's option schema: a dict `{type|value_type, default,
        choices?, validator?}` or a `BackendOptionSpec` (any object with those attributes)."""
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
            raise ValueError(f"{source}: key {name!r} is not a valid keyword argument name")
        where = f"{source}[{name!r}]"
        if isinstance(spec, Mapping):
            entry = {str(k): v for k, v in spec.items()}
            for key in sorted(set(entry) - set(RETRAIN_SPEC_KEYS)):
                close = nearest(key, RETRAIN_SPEC_KEYS)
                hint = f" (did you mean {close!r}?)" if close else ""
                raise ValueError(
                    f"{where}: unknown key {key!r}{hint}; an entry takes {list(RETRAIN_SPEC_KEYS)}"
                )
        elif hasattr(spec, "value_type"):
            entry = {k: getattr(spec, k) for k in RETRAIN_SPEC_KEYS if hasattr(spec, k)}
        else:
            raise ValueError(
                f"{where}: got a {type(spec).__name__}; give a dict "
                "{'type': 'int', 'default': 2, 'choices': [...], 'validator': fn} "
                "or a BackendOptionSpec"
            )
        value_type = _value_type(entry, where)
        default, choices, validator = (entry.get(k) for k in ("default", "choices", "validator"))
        if default is not None and not (is_scalar(default) and _is_a(default, value_type)):
            raise ValueError(
                f"{where}: default {default!r} is not a {value_type.__name__}; "
                "make it one, or change the type"
            )
        if choices is not None:
            if not isinstance(choices, list | tuple) or not all(
                is_scalar(c) and _is_a(c, value_type) for c in choices
            ):
                raise ValueError(f"{where}: choices must be a list of {value_type.__name__} values")
            choices = tuple(choices)
        if validator is not None and not callable(validator):
            raise ValueError(
                f"{where}: validator must be a function value -> error message or None, "
                f"got a {type(validator).__name__}"
            )
        option = cls(name, value_type, default, choices, validator, source)
        if default is not None and (problem := option.problem(default)) is not None:
            raise ValueError(f"{where}: the default {default!r} is refused: {problem}; fix either")
        return option


def _value_type(entry: Mapping[str, object], where: str) -> type:
    """bool, int, float or str, from `type` or `value_type` (a name or the type); str if
    neither is given, as retrain reads it."""
    given = [entry[k] for k in ("type", "value_type") if k in entry]
    found: list[type] = []
    for raw in given:
        resolved = VALUE_TYPES.get(raw.strip().lower()) if isinstance(raw, str) else raw
        if resolved not in (bool, int, float, str):
            raise ValueError(
                f"{where}: type {raw!r} is not one of bool, int, float, str "
                "(as a name or the Python type)"
            )
        found.append(resolved)
    if len(set(found)) > 1:
        raise ValueError(f"{where}: type and value_type disagree ({given}); give one of them")
    return found[0] if found else str


def _is_a(value: object, value_type: type) -> bool:
    """isinstance, except that a bool is not an int and an int is a float (TOML writes 1 for 1.0)."""
    if isinstance(value, bool):
        return value_type is bool
    if value_type is float:
        return isinstance(value, int | float)
    return isinstance(value, value_type)


def with_backend_options(
    parameters: Sequence[ParameterSchema], options: Sequence[BackendOption], label: str
) -> list[ParameterSchema]:
    """The constructor's parameters with the declared options merged in. A declared option
    must be a parameter, unless the constructor takes `**kwargs`; a parameter's own default
    must equal the declared one (the listing shows what the constructor gets)."""
    rows = list(parameters)
    index = {p.name: i for i, p in enumerate(rows)}
    open_ended = [i for i, p in enumerate(rows) if p.name.startswith("**")]
    for option in options:
        where = f"{option.declared_by}[{option.name!r}]"
        type_name = option.value_type.__name__
        if option.name in index:
            row = rows[index[option.name]]
            if not row.required and row.default != option.default:
                raise ValueError(
                    f"{where}: default {option.default!r} differs from {label}'s own default "
                    f"{row.default!r}; make them the same"
                )
            required = row.required and option.default is None
            rows[index[option.name]] = replace(
                row, type=type_name, default=option.default, required=required, option=option
            )
        elif open_ended:
            row = ParameterSchema(option.name, type_name, option.default, False, option)
            rows.insert(open_ended[0], row)
            open_ended[0] += 1
        else:
            takes = ", ".join(p.name for p in rows) or "nothing"
            raise ValueError(
                f"{where}: {label}(...) has no parameter {option.name!r} and takes no **kwargs "
                f"(it takes: {takes}); add the parameter or remove the entry"
            )
    return rows
