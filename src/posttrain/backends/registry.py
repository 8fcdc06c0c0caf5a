"""Finding backends: built-ins by name, plugins by dotted path or the `posttrain.backends`
entry-point group, each described with its capabilities and option schemas.

A backend (a class, or any factory returning a backend) declares `capabilities` (a
`Capabilities`), `rl_options` / `sft_options` (TypedDicts) and `rl_config` / `sft_config` (their
defaults). A plugin may instead give hooks, on the factory or on its module:
`posttrain_capabilities()` returning a dict of every capability, and
`posttrain_option_schema()` returning `{"train": [...], "train_sft": [...]}` of option dicts
(name, type, default, choices, description). Without hooks a plugin gets conservative
capabilities and an empty schema, so preflight refuses any option set away from its default.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import importlib.util
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from posttrain.backends.capabilities import CONSERVATIVE, Capabilities
from posttrain.backends.schema import (
    OptionSchema,
    ParameterSchema,
    constructor_schema,
    option_schema,
)
from posttrain.trainer.config import RLConfig, SFTConfig

ENTRY_POINT_GROUP = "posttrain.backends"
CAPABILITIES_HOOK = "posttrain_capabilities"
OPTION_SCHEMA_HOOK = "posttrain_option_schema"
TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
Source = Literal["builtin", "entry_point", "plugin"]
CapabilitiesSource = Literal["declared", "hook", "default"]
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
    constructor: list[ParameterSchema] = field(default_factory=list[ParameterSchema])

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
            "options": {
                "train": [o.as_dict() for o in self.train_options],
                "train_sft": [o.as_dict() for o in self.train_sft_options],
            },
            "constructor": [p.as_dict() for p in self.constructor],
        }


def import_target(target: str) -> Factory:
    """`package.module:Attribute` to the object, with errors that say what to fix."""
    if not TARGET.match(target):
        raise ValueError(
            f"backend {target!r} is not a dotted path; write it as 'package.module:ClassName'"
        )
    module_name, _, attr = target.partition(":")
    try:
        obj: object = importlib.import_module(module_name)
    except Exception as exc:  # a plugin module may fail in any way; report it, never crash
        raise ImportError(
            f"cannot import module {module_name!r} for backend {target!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ImportError(
                f"module {module_name!r} has no attribute {attr!r} (backend {target!r})"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ImportError(f"backend {target!r} is a {type(obj).__name__}, not a class or factory")
    return obj


def entry_points() -> dict[str, str]:
    """Installed plugins: name -> target, from the `posttrain.backends` entry-point group."""
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def known_names() -> list[str]:
    return [*BUILTINS, *sorted(set(entry_points()) - set(BUILTINS))]


def resolve(spec: str) -> Resolved:
    """Where a backend name or dotted path points; an unknown name lists the known ones."""
    if ":" in spec:
        if not TARGET.match(spec):
            raise ValueError(
                f"backend {spec!r} is not a dotted path; write it as 'package.module:ClassName'"
            )
        return Resolved(spec, spec, "plugin", None)
    if spec in BUILTINS:
        return Resolved(spec, BUILTINS[spec].target, "builtin", BUILTINS[spec].extra)
    installed = entry_points()
    if spec in installed:
        return Resolved(spec, installed[spec], "entry_point", None)
    known = known_names()
    close = difflib.get_close_matches(spec, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"unknown backend {spec!r}; known backends: {', '.join(known)}.{hint} "
        "A plugin is named by its dotted path, e.g. 'mypkg.backends:MyBackend'."
    )


def load(spec: str) -> Factory:
    """The backend class (or factory) for a name, an entry-point name or a dotted path."""
    resolved = resolve(spec)
    try:
        return import_target(resolved.target)
    except ImportError as exc:
        if resolved.extra:
            raise ImportError(
                f"backend {spec!r} needs the {resolved.extra!r} extra: "
                f"pip install 'posttrain[{resolved.extra}]' ({exc})"
            ) from exc
        raise


def _hook(backend: object, name: str, source: str) -> Callable[[], object] | None:
    """The hook on the factory, else on its module; a hook that is not a function is an error."""
    hook = getattr(backend, name, None)
    if hook is None:
        module = sys.modules.get(getattr(backend, "__module__", "") or "")
        hook = getattr(module, name, None)
    if hook is None:
        return None
    if not callable(hook):
        raise ValueError(f"{source}: {name} must be a function, got a {type(hook).__name__}")
    return hook


def _call(hook: Callable[[], object], name: str, source: str) -> object:
    try:
        return hook()
    except Exception as exc:  # plugin code: report what it raised, where
        raise ValueError(f"{source}: {name}() raised {type(exc).__name__}: {exc}") from exc


def capabilities_of(backend: object, source: str) -> tuple[Capabilities, CapabilitiesSource]:
    declared = getattr(backend, "capabilities", None)
    if isinstance(declared, Capabilities):
        return declared, "declared"
    if declared is not None:
        raise ValueError(
            f"{source}: `capabilities` must be a posttrain.backends.capabilities.Capabilities, "
            f"got a {type(declared).__name__}; or give a {CAPABILITIES_HOOK}() hook returning a dict"
        )
    hook = _hook(backend, CAPABILITIES_HOOK, source)
    if hook is None:
        return CONSERVATIVE, "default"
    values = _call(hook, CAPABILITIES_HOOK, source)
    if not isinstance(values, Mapping):
        raise ValueError(
            f"{source}: {CAPABILITIES_HOOK}() must return a dict, got {type(values).__name__}"
        )
    return Capabilities.from_mapping(values, f"{source}: {CAPABILITIES_HOOK}()"), "hook"  # type: ignore[arg-type]


def _schema_from_hook(values: object, source: str) -> tuple[list[OptionSchema], list[OptionSchema]]:
    where = f"{source}: {OPTION_SCHEMA_HOOK}()"
    if not isinstance(values, Mapping) or not set(values) <= {"train", "train_sft"}:
        raise ValueError(
            f"{where} must return {{'train': [...], 'train_sft': [...]}}, got {values!r}"
        )
    out: list[list[OptionSchema]] = []
    for key in ("train", "train_sft"):
        rows = values.get(key, [])  # a hook may leave out a call it has no options for
        if not isinstance(rows, list | tuple):
            raise ValueError(f"{where}[{key!r}] must be a list of option dicts")
        out.append([OptionSchema.from_mapping(row, f"{where}[{key!r}]") for row in rows])
        names = [o.name for o in out[-1]]
        if len(set(names)) != len(names):
            raise ValueError(f"{where}[{key!r}] lists an option twice: {names}")
    return out[0], out[1]


def _typed_options(
    backend: object, attr: str, config_attr: str, default: type, source: str
) -> list[OptionSchema]:
    options = getattr(backend, attr, None)
    if options is None:
        return []
    if not isinstance(options, type):
        raise ValueError(f"{source}: `{attr}` must be a TypedDict class, got {options!r}")
    return option_schema(options, getattr(backend, config_attr, default))


def options_of(backend: object, source: str) -> tuple[list[OptionSchema], list[OptionSchema]]:
    """(train, train_sft) option schemas: typed declarations first, else the hook, else none."""
    if (
        getattr(backend, "rl_options", None) is not None
        or getattr(backend, "sft_options", None) is not None
    ):
        train = _typed_options(backend, "rl_options", "rl_config", RLConfig, source)
        return train, _typed_options(backend, "sft_options", "sft_config", SFTConfig, source)
    hook = _hook(backend, OPTION_SCHEMA_HOOK, source)
    return _schema_from_hook(_call(hook, OPTION_SCHEMA_HOOK, source), source) if hook else ([], [])


def describe(spec: str) -> BackendInfo:
    """Everything known about one backend. A bad name or malformed hooks raise ValueError;
    a backend that cannot be imported is described as such (`importable=False`)."""
    r = resolve(spec)
    try:
        backend = import_target(r.target)
    except ImportError as exc:
        return BackendInfo(r.name, r.target, r.source, r.extra, False, str(exc))
    caps, caps_source = capabilities_of(backend, r.target)
    train, train_sft = options_of(backend, r.target)
    missing = _missing_dependency(r.name if r.source == "builtin" else None)
    return BackendInfo(
        r.name,
        r.target,
        r.source,
        r.extra,
        importable=missing is None,
        import_error=missing,
        capabilities=caps,
        capabilities_source=caps_source,
        train_options=train,
        train_sft_options=train_sft,
        constructor=constructor_schema(backend),
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
        "default_capabilities": CONSERVATIVE.as_dict(),
    }
