"""Finding backends: built-ins by name, plugins by dotted path or the `posttrain.backends`
entry-point group, each described with its capabilities and option schemas.

A backend class declares `capabilities` (a `Capabilities`), `rl_options` / `sft_options`
(TypedDicts) and `rl_config` / `sft_config` (their defaults). A plugin may instead give hooks:
`posttrain_capabilities()` returning a dict, and `posttrain_option_schema()` returning
`{"train": [...], "train_sft": [...]}` of option dicts, on the class or its module. Without
hooks a plugin gets conservative capabilities and an empty schema.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from posttrain.backends.capabilities import CONSERVATIVE, Capabilities
from posttrain.backends.schema import OptionSchema, option_schema
from posttrain.trainer.config import RLConfig, SFTConfig

ENTRY_POINT_GROUP = "posttrain.backends"
Source = Literal["builtin", "entry_point", "plugin"]


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
class BackendInfo:
    name: str
    target: str
    source: Source
    extra: str | None
    importable: bool
    import_error: str | None = None
    capabilities: Capabilities = CONSERVATIVE
    capabilities_source: Literal["declared", "hook", "default"] = "default"
    train_options: list[OptionSchema] = field(default_factory=list[OptionSchema])
    train_sft_options: list[OptionSchema] = field(default_factory=list[OptionSchema])

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "target": self.target,
            "source": self.source,
            "extra": self.extra,
            "install": f"pip install 'posttrain[{self.extra}]'" if self.extra else None,
            "importable": self.importable,
            "import_error": self.import_error,
            "capabilities": self.capabilities.as_dict(),
            "capabilities_source": self.capabilities_source,
            "options": {
                "train": [o.as_dict() for o in self.train_options],
                "train_sft": [o.as_dict() for o in self.train_sft_options],
            },
        }


def import_target(target: str) -> type:
    """`package.module:Attribute` to the object, with errors that say what to fix."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"backend {target!r} is not a dotted path; write it as 'package.module:ClassName'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(
            f"cannot import module {module_name!r} for backend {target!r}: {exc}"
        ) from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImportError(
            f"module {module_name!r} has no attribute {attr!r} (backend {target!r})"
        ) from None


def entry_points() -> dict[str, str]:
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def resolve(spec: str) -> tuple[str, str, Source, str | None]:
    """(name, target, source, extra) for a backend name or dotted path."""
    if ":" in spec:
        return spec, spec, "plugin", None
    if spec in BUILTINS:
        return spec, BUILTINS[spec].target, "builtin", BUILTINS[spec].extra
    installed = entry_points()
    if spec in installed:
        return spec, installed[spec], "entry_point", None
    known = sorted({*BUILTINS, *installed})
    close = difflib.get_close_matches(spec, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"unknown backend {spec!r}; known backends: {', '.join(known)}.{hint} "
        "A plugin is named by its dotted path, e.g. 'mypkg.backends:MyBackend'."
    )


def load(spec: str) -> type:
    """The backend class (or factory) for a name or a dotted path."""
    _, target, _, extra = resolve(spec)
    try:
        return import_target(target)
    except ImportError as exc:
        if extra:
            raise ImportError(
                f"backend {spec!r} needs the {extra!r} extra: pip install 'posttrain[{extra}]' ({exc})"
            ) from exc
        raise


def _hook(backend: object, name: str) -> Callable[[], object] | None:
    hook = getattr(backend, name, None)
    if hook is None:
        module = importlib.import_module(getattr(backend, "__module__", "builtins"))
        hook = getattr(module, name, None)
    return hook if callable(hook) else None


def capabilities_of(
    backend: object, source: str
) -> tuple[Capabilities, Literal["declared", "hook", "default"]]:
    declared = getattr(backend, "capabilities", None)
    if isinstance(declared, Capabilities):
        return declared, "declared"
    hook = _hook(backend, "posttrain_capabilities")
    if hook is None:
        return CONSERVATIVE, "default"
    values = hook()
    if not isinstance(values, Mapping):
        raise ValueError(
            f"{source}: posttrain_capabilities() must return a dict, got {type(values).__name__}"
        )
    return Capabilities.from_mapping(values, f"{source}: posttrain_capabilities()"), "hook"  # type: ignore[arg-type]


def _schema_from_hook(values: object, source: str) -> tuple[list[OptionSchema], list[OptionSchema]]:
    if not isinstance(values, Mapping) or not set(values) <= {"train", "train_sft"}:
        raise ValueError(
            f"{source}: posttrain_option_schema() must return {{'train': [...], 'train_sft': [...]}}"
        )
    out: list[list[OptionSchema]] = []
    for key in ("train", "train_sft"):
        rows = values.get(key, [])
        try:
            out.append([OptionSchema(**row) for row in rows])  # type: ignore[arg-type]
        except TypeError as exc:
            raise ValueError(f"{source}: malformed option schema under {key!r}: {exc}") from None
    return out[0], out[1]


def options_of(backend: object, source: str) -> tuple[list[OptionSchema], list[OptionSchema]]:
    rl, sft = getattr(backend, "rl_options", None), getattr(backend, "sft_options", None)
    if isinstance(rl, type) or isinstance(sft, type):
        train = (
            option_schema(rl, getattr(backend, "rl_config", RLConfig))
            if isinstance(rl, type)
            else []
        )
        train_sft = (
            option_schema(sft, getattr(backend, "sft_config", SFTConfig))
            if isinstance(sft, type)
            else []
        )
        return train, train_sft
    hook = _hook(backend, "posttrain_option_schema")
    return _schema_from_hook(hook(), source) if hook else ([], [])


def describe(spec: str) -> BackendInfo:
    """Everything `posttrain backends` shows about one backend; import failures are reported."""
    name, target, source, extra = resolve(spec)
    try:
        backend = import_target(target)
    except ImportError as exc:
        return BackendInfo(name, target, source, extra, importable=False, import_error=str(exc))
    caps, caps_source = capabilities_of(backend, target)
    train, train_sft = options_of(backend, target)
    missing = _missing_dependency(name if source == "builtin" else None)
    return BackendInfo(
        name, target, source, extra, missing is None, missing, caps, caps_source, train, train_sft
    )


def _missing_dependency(builtin: str | None) -> str | None:
    """Why a built-in backend whose dependency is imported lazily cannot run now, or None."""
    requires = BUILTINS[builtin].requires if builtin in BUILTINS else None
    if requires is None or importlib.util.find_spec(requires) is not None:
        return None
    return f"No module named {requires!r}"


def all_backends() -> list[BackendInfo]:
    return [describe(name) for name in [*BUILTINS, *sorted(set(entry_points()) - set(BUILTINS))]]
