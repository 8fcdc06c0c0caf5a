"""A backend's declarations: its own attributes, else posttrain's plugin hooks, else retrain's.

Each hook is looked for on the factory, then on its module, and may be a function or a
constant. A function is called with the backend options (the job's `[backend]` table, `{}` when
listing) when it takes an argument, as retrain calls its hooks, and with none otherwise.

- Capabilities: a `capabilities` attribute (a `Capabilities`), else `posttrain_capabilities`
  (every flag), else retrain's `retrain_backend_capabilities` / `RETRAIN_BACKEND_CAPABILITIES`
  (its four flags, the rest conservative; see `Capabilities.from_retrain`), else CONSERVATIVE.
  posttrain's hook wins over retrain's wherever each is; a hook that loses is reported.
- `train()` / `train_sft()` / `train_dpo()` options: `rl_options` / `sft_options` /
  `dpo_options` TypedDicts, else `posttrain_option_schema` (each call's list optional).
- `[backend]` options: retrain's `retrain_backend_option_schema` /
  `RETRAIN_BACKEND_OPTION_SCHEMA`, a mapping name -> `{type|value_type, default, choices?,
  validator?}`. retrain's backend options are what posttrain's `[backend]` table holds, the
  constructor's keyword arguments, so that is where they apply (`schema.with_backend_options`).

retrain's own lookup order holds between its two names: the lowercase name on the factory, then
on the module, then the uppercase one.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from posttrain.backends.capabilities import CONSERVATIVE, Capabilities
from posttrain.backends.plugins.backend_options import BackendOption
from posttrain.backends.plugins.schema import OptionSchema, option_schema
from posttrain.trainer.config import DPOConfig, RLConfig, SFTConfig

CAPABILITIES_HOOK = "posttrain_capabilities"
OPTION_SCHEMA_HOOK = "posttrain_option_schema"
CALLS = ("train", "train_sft", "train_dpo")  # the calls an option schema describes
RETRAIN_CAPABILITIES_HOOKS = ("retrain_backend_capabilities", "RETRAIN_BACKEND_CAPABILITIES")
RETRAIN_OPTION_SCHEMA_HOOKS = ("retrain_backend_option_schema", "RETRAIN_BACKEND_OPTION_SCHEMA")
PRECEDENCE = (
    "the factory's `capabilities` attribute, else posttrain_capabilities, else "
    "retrain_backend_capabilities / RETRAIN_BACKEND_CAPABILITIES, else the conservative defaults"
)
CapabilitiesSource = Literal["declared", "hook", "default"]


@dataclass(frozen=True)
class Hook:
    name: str
    value: object  # a function, or the constant itself

    def label(self) -> str:
        """How messages name it: `name()` for a function, `name` for a constant."""
        return f"{self.name}()" if callable(self.value) else self.name


@dataclass(frozen=True)
class Declarations:
    """What a backend declares, and which hook gave each part (None: its own attributes or
    nothing); `overridden` lists hooks it has that a higher-precedence declaration beat."""

    capabilities: Capabilities = CONSERVATIVE
    capabilities_source: CapabilitiesSource = "default"
    capabilities_hook: str | None = None
    train: list[OptionSchema] = field(default_factory=list[OptionSchema])
    train_sft: list[OptionSchema] = field(default_factory=list[OptionSchema])
    train_dpo: list[OptionSchema] = field(default_factory=list[OptionSchema])
    option_schema_hook: str | None = None
    backend_options: list[BackendOption] = field(default_factory=list[BackendOption])
    backend_options_hook: str | None = None
    overridden: tuple[str, ...] = ()


def find_hooks(backend: object, names: tuple[str, ...]) -> list[Hook]:
    """Every hook of these names, in precedence order: each name on the factory, then on
    its module."""
    module = sys.modules.get(getattr(backend, "__module__", "") or "")
    found: list[Hook] = []
    for name in names:
        for holder in (backend, module):
            value = getattr(holder, name, None) if holder is not None else None
            if value is not None:
                found.append(Hook(name, value))
    return found


def hook_value(hook: Hook, options: Mapping[str, object], source: str) -> object:
    """The constant, or what the function returns; what a hook raises is a ValueError naming
    `source` and the hook."""
    if not callable(hook.value):
        return hook.value
    try:
        signature = inspect.signature(hook.value)
    except (TypeError, ValueError):  # a builtin without a signature: call it bare
        signature = None
    takes_options = signature is not None and _binds(signature, dict(options))
    if signature is not None and not takes_options and not _binds(signature):
        raise ValueError(
            f"{source}: {hook.label()} must take no argument or one (the backend options), "
            f"its signature is {signature}"
        )
    try:
        return hook.value(dict(options)) if takes_options else hook.value()
    except Exception as exc:  # plugin code: report what it raised, where
        raise ValueError(f"{source}: {hook.label()} raised {type(exc).__name__}: {exc}") from exc


def _binds(signature: inspect.Signature, *args: object) -> bool:
    try:
        signature.bind(*args)
    except TypeError:
        return False
    return True


def _capabilities(
    backend: object, source: str, options: Mapping[str, object]
) -> tuple[Capabilities, CapabilitiesSource, str | None, list[Hook]]:
    """(capabilities, source, the hook used, hooks found but beaten)."""
    declared = getattr(backend, "capabilities", None)
    if declared is not None and not isinstance(declared, Capabilities):
        raise ValueError(
            f"{source}: `capabilities` must be a posttrain.backends.capabilities.Capabilities, "
            f"got a {type(declared).__name__}; or give a {CAPABILITIES_HOOK}() hook returning a dict"
        )
    posttrain_hooks = find_hooks(backend, (CAPABILITIES_HOOK,))
    retrain_hooks = find_hooks(backend, RETRAIN_CAPABILITIES_HOOKS)
    if declared is not None:
        return declared, "declared", None, posttrain_hooks + retrain_hooks
    if posttrain_hooks:
        hook = posttrain_hooks[0]
        value = hook_value(hook, options, source)
        where = f"{source}: {hook.label()}"
        if isinstance(value, Capabilities):
            return value, "hook", hook.name, posttrain_hooks[1:] + retrain_hooks
        if not isinstance(value, Mapping):
            raise ValueError(
                f"{where} must return a dict of every capability flag or a Capabilities, "
                f"got {type(value).__name__}"
            )
        caps = Capabilities.from_mapping(value, where)
        return caps, "hook", hook.name, posttrain_hooks[1:] + retrain_hooks
    if retrain_hooks:
        hook = retrain_hooks[0]
        value = hook_value(hook, options, source)
        if not isinstance(value, Capabilities):
            value = Capabilities.from_retrain(value, f"{source}: {hook.label()}")
        return value, "hook", hook.name, retrain_hooks[1:]
    return CONSERVATIVE, "default", None, []


def _schema_from_hook(values: object, where: str) -> list[list[OptionSchema]]:
    """[train, train_sft, train_dpo] option lists from a hook's mapping (keys optional)."""
    if not isinstance(values, Mapping) or not set(values) <= set(CALLS):
        raise ValueError(
            f"{where} must return {{'train': [...], 'train_sft': [...], 'train_dpo': [...]}} "
            f"(each optional), got {values!r}"
        )
    out: list[list[OptionSchema]] = []
    for key in CALLS:
        rows = values.get(key, [])  # a hook may leave out a call it has no options for
        if not isinstance(rows, list | tuple):
            raise ValueError(f"{where}[{key!r}] must be a list of option dicts")
        out.append([OptionSchema.from_mapping(row, f"{where}[{key!r}]") for row in rows])
        names = [o.name for o in out[-1]]
        if len(set(names)) != len(names):
            raise ValueError(f"{where}[{key!r}] lists an option twice: {names}")
    return out


def _typed_options(
    backend: object, attr: str, config_attr: str, default: type, source: str
) -> list[OptionSchema]:
    options = getattr(backend, attr, None)
    if options is None:
        return []
    if not isinstance(options, type):
        raise ValueError(f"{source}: `{attr}` must be a TypedDict class, got {options!r}")
    return option_schema(options, getattr(backend, config_attr, default))


def _call_options(
    backend: object, source: str, options: Mapping[str, object]
) -> tuple[list[list[OptionSchema]], str | None, list[Hook]]:
    """([train, train_sft, train_dpo] options, the hook used, hooks beaten): typed
    declarations, else the hook."""
    hooks = find_hooks(backend, (OPTION_SCHEMA_HOOK,))
    typed = (("rl_options", "rl_config", RLConfig), ("sft_options", "sft_config", SFTConfig))
    typed += (("dpo_options", "dpo_config", DPOConfig),)
    if any(getattr(backend, attr, None) is not None for attr, _, _ in typed):
        lists = [_typed_options(backend, a, c, default, source) for a, c, default in typed]
        return lists, None, hooks
    if not hooks:
        return [[], [], []], None, []
    value = hook_value(hooks[0], options, source)
    return _schema_from_hook(value, f"{source}: {hooks[0].label()}"), hooks[0].name, hooks[1:]


def _backend_options(
    backend: object, source: str, options: Mapping[str, object]
) -> tuple[list[BackendOption], str | None, list[Hook]]:
    hooks = find_hooks(backend, RETRAIN_OPTION_SCHEMA_HOOKS)
    if not hooks:
        return [], None, []
    value = hook_value(hooks[0], options, source)
    where = f"{source}: {hooks[0].label()}"
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{where} must return a mapping option name -> {{type|value_type, default, "
            f"choices?, validator?}}, got {type(value).__name__}"
        )
    declared = [BackendOption.from_retrain(k, v, where) for k, v in value.items()]
    return declared, hooks[0].name, hooks[1:]


def read_declarations(
    backend: object, source: str, options: Mapping[str, object] | None = None
) -> Declarations:
    """Everything `backend` declares; malformed declarations raise ValueError naming `source`,
    the hook, the key and the fix. `options` are the backend options hooks may take."""
    given = options or {}
    caps, caps_source, caps_hook, beaten = _capabilities(backend, source, given)
    (train, train_sft, train_dpo), schema_hook, beaten_schema = _call_options(
        backend, source, given
    )
    backend_options, options_hook, beaten_options = _backend_options(backend, source, given)
    used = {caps_hook, schema_hook, options_hook}
    # A name on both the factory and its module is plain shadowing, not a hook that lost.
    overridden = [h.name for h in [*beaten, *beaten_schema, *beaten_options] if h.name not in used]
    return Declarations(
        capabilities=caps,
        capabilities_source=caps_source,
        capabilities_hook=caps_hook,
        train=train,
        train_sft=train_sft,
        train_dpo=train_dpo,
        option_schema_hook=schema_hook,
        backend_options=backend_options,
        backend_options_hook=options_hook,
        overridden=tuple(dict.fromkeys(overridden)),
    )
