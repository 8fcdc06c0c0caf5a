"""Finding backends: built-ins by name, plugins by dotted path or the `posttrain.backends`
entry-point group, each described with its capabilities and option schemas.

A backend (a class, or any factory returning a backend) declares `capabilities` (a
`Capabilities`), `rl_options` / `sft_options` / `dpo_options` (TypedDicts) and `rl_config` /
`sft_config` / `dpo_config` (their defaults). A plugin may instead give hooks, on the factory or on its module:
`posttrain_capabilities` giving a dict of every capability, and `posttrain_option_schema`
giving `{"train": [...], "train_sft": [...], "train_dpo": [...]}` of option dicts (name, type, default, choices,
description). retrain's hooks are read too (`plugins.hooks` has the names, formats and which
wins). Without hooks a plugin gets conservative capabilities and an empty schema, so preflight
refuses any option set away from its default.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from posttrain.backends.capabilities import CONSERVATIVE, Capabilities
from posttrain.backends.plugins.backend_options import with_backend_options
from posttrain.backends.plugins.hooks import (
    CAPABILITIES_HOOK,
    OPTION_SCHEMA_HOOK,
    PRECEDENCE,
    RETRAIN_CAPABILITIES_HOOKS,
    RETRAIN_OPTION_SCHEMA_HOOKS,
    CapabilitiesSource,
    read_declarations,
)
from posttrain.backends.plugins.schema import OptionSchema, ParameterSchema, constructor_schema
from posttrain.finder import Kind, find, import_object
from posttrain.finder import entry_points as installed

ENTRY_POINT_GROUP = "posttrain.backends"
Source = Literal["builtin", "entry_point", "plugin"]
Factory = Callable[..., object]


@dataclass(frozen=True)
class Builtin:
    target: str
    extra: str | None  # the pip extra that installs its dependencies
    requires: str | None = None  # the module that extra provides (imported lazily by the backend)


BUILTINS: dict[str, Builtin] = {
    "local": Builtin("posttrain.backends.local:LocalBackend", None),
    "ray": Builtin("posttrain.backends.ray:RayBackend", "ray", "ray"),
    "tinker": Builtin("posttrain.backends.tinker:TinkerBackend", "tinker", "tinker"),
}


@dataclass(frozen=True)
class Resolved:
    name: str
    target: str  # package.module:Attribute
    source: Source
    extra: str | None
    what: str = "backend"  # how import errors name it (an entry point: with its name)


HOOK_PARTS = ("capabilities", "option_schema", "backend_options")


@dataclass(frozen=True)
class BackendInfo:
    """What `posttrain backends` shows about one backend."""

    name: str
    target: str
    source: Source
    extra: str | None
    importable: bool
    import_error: str | None = None
    error: str | None = None  # imported, but its hooks or declarations are malformed
    capabilities: Capabilities = CONSERVATIVE
    capabilities_source: CapabilitiesSource = "default"
    train_options: list[OptionSchema] = field(default_factory=list[OptionSchema])
    train_sft_options: list[OptionSchema] = field(default_factory=list[OptionSchema])
    train_dpo_options: list[OptionSchema] = field(default_factory=list[OptionSchema])
    constructor: list[ParameterSchema] = field(default_factory=list[ParameterSchema])
    # The hook that gave the capabilities, the train options and the [backend] options (None:
    # declared by the factory itself, or nothing), and hooks it has that lost to another.
    hooks: Mapping[str, str | None] = field(default_factory=dict[str, str | None])
    overridden_hooks: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """How messages name it: the class or factory name."""
        return self.target.rpartition(":")[2]

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "target": self.target,
            "source": self.source,
            "extra": self.extra,
            "install": f"pip install 'posttrain[{self.extra}]'" if self.extra else None,
            "importable": self.importable,
            "import_error": self.import_error,
            "error": self.error,
            "capabilities": self.capabilities.as_dict(),
            "capabilities_source": self.capabilities_source,
            "hooks": {
                **{k: self.hooks.get(k) for k in HOOK_PARTS},
                "overridden": list(self.overridden_hooks),
            },
            "options": {
                "train": [o.as_dict() for o in self.train_options],
                "train_sft": [o.as_dict() for o in self.train_sft_options],
                "train_dpo": [o.as_dict() for o in self.train_dpo_options],
            },
            "constructor": [p.as_dict() for p in self.constructor],
        }


BACKENDS = Kind(
    "backend",
    BUILTINS,
    ENTRY_POINT_GROUP,
    example="mypkg.backends:MyBackend",
    form="package.module:ClassName",
)


def import_target(target: str, what: str = "backend") -> Factory:
    """`package.module:Attribute` to the object, with errors that say what to fix."""
    obj = import_object(target, what)
    if not callable(obj):
        raise ImportError(f"backend {target!r} is a {type(obj).__name__}, not a class or factory")
    return obj


def entry_points() -> dict[str, str]:
    """Installed plugins: name -> target, from the `posttrain.backends` entry-point group."""
    return installed(ENTRY_POINT_GROUP)


def known_names() -> list[str]:
    return BACKENDS.known()


def resolve(spec: str) -> Resolved:
    """Where a backend name or dotted path points; an unknown name lists the known ones."""
    found = find(spec, BACKENDS)
    if found.source == "builtin":
        return Resolved(spec, BUILTINS[spec].target, "builtin", BUILTINS[spec].extra, found.what)
    source: Source = "plugin" if found.source == "path" else "entry_point"
    return Resolved(spec, found.target, source, None, found.what)


def load(spec: str) -> Factory:
    """The backend class (or factory) for a name, an entry-point name or a dotted path."""
    resolved = resolve(spec)
    try:
        return import_target(resolved.target, resolved.what)
    except ImportError as exc:
        if resolved.extra:
            raise ImportError(
                f"backend {spec!r} needs the {resolved.extra!r} extra: "
                f"pip install 'posttrain[{resolved.extra}]' ({exc})"
            ) from exc
        raise


def describe(spec: str, backend_options: Mapping[str, object] | None = None) -> BackendInfo:
    """Everything known about one backend. A bad name or malformed hooks raise ValueError;
    a backend that cannot be imported is described as such (`importable=False`).
    `backend_options` (a job's `[backend]` table) go to hooks that take them."""
    r = resolve(spec)
    try:
        backend = import_target(r.target, r.what)
    except ImportError as exc:
        return BackendInfo(r.name, r.target, r.source, r.extra, False, str(exc))
    found = read_declarations(backend, r.target, backend_options)
    label = r.target.rpartition(":")[2]
    constructor = with_backend_options(constructor_schema(backend), found.backend_options, label)
    missing = _missing_dependency(r.name if r.source == "builtin" else None)
    return BackendInfo(
        r.name,
        r.target,
        r.source,
        r.extra,
        importable=missing is None,
        import_error=missing,
        capabilities=found.capabilities,
        capabilities_source=found.capabilities_source,
        train_options=found.train,
        train_sft_options=found.train_sft,
        train_dpo_options=found.train_dpo,
        constructor=constructor,
        hooks={
            "capabilities": found.capabilities_hook,
            "option_schema": found.option_schema_hook,
            "backend_options": found.backend_options_hook,
        },
        overridden_hooks=found.overridden,
    )


def describe_or_report(spec: str) -> BackendInfo:
    """`describe`, with malformed declarations reported in `error` instead of raised."""
    try:
        return describe(spec)
    except ValueError as exc:
        r = resolve(spec)
        return BackendInfo(r.name, r.target, r.source, r.extra, True, error=str(exc))


def _missing_dependency(builtin: str | None) -> str | None:
    """Why a built-in backend whose dependency is imported lazily cannot run now, or None."""
    requires = BUILTINS[builtin].requires if builtin in BUILTINS else None
    if requires is None or importlib.util.find_spec(requires) is not None:
        return None
    return f"No module named {requires!r}"


def all_backends() -> list[BackendInfo]:
    """Built-ins, then installed entry-point plugins; a broken plugin is reported, not raised."""
    return [describe_or_report(name) for name in known_names()]


def plugin_contract() -> dict[str, object]:
    """How a plugin declares itself (shown by `posttrain backends`)."""
    return {
        "dotted_path": "package.module:Factory",
        "entry_point_group": ENTRY_POINT_GROUP,
        "capabilities_hook": CAPABILITIES_HOOK,
        "option_schema_hook": OPTION_SCHEMA_HOOK,
        "retrain_capabilities_hooks": list(RETRAIN_CAPABILITIES_HOOKS),
        "retrain_option_schema_hooks": list(RETRAIN_OPTION_SCHEMA_HOOKS),
        "precedence": PRECEDENCE,
        "default_capabilities": CONSERVATIVE.as_dict(),
    }
