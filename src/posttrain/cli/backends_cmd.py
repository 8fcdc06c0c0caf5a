"""`posttrain backends [--json] [--plugin PKG.MODULE:FACTORY ...]`: every backend, its
dependencies, capabilities, option schemas and constructor arguments; the sampling engines
with their capabilities, and which backends take `inference=` to choose one.

Exit status: 0, or 1 when a backend asked for with `--plugin` cannot be resolved, imported or
described (each such backend is reported, never a traceback).
"""

from __future__ import annotations

import argparse
import json
import sys

from posttrain.backends.plugins.registry import (
    BackendInfo,
    all_backends,
    describe_or_report,
    plugin_contract,
    resolve,
)
from posttrain.backends.plugins.schema import ParameterSchema
from posttrain.cli.engine_table import (
    ENGINE_MODES,
    OPENAI_PROBED,
    accepts_inference,
    capability_flags,
)

# 2: adds "error" and "constructor" to each backend and the top-level "plugins" contract.
# 3: adds "hooks" to each backend, "choices" and "has_validator" to each constructor argument,
#    and retrain's hook names and the precedence to "plugins".
# 4: adds "accepts_inference" to each backend and the top-level "engines".
SCHEMA_VERSION = 6  # 5: supports_critic, train_dpo options; 6: supports_full_finetuning


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("backends", help="list backends with capabilities and options")
    parser.add_argument(
        "--json", action="store_true", help=f"machine-readable output (schema v{SCHEMA_VERSION})"
    )
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="PKG.MODULE:FACTORY",
        help="also describe this plugin backend (repeatable)",
    )
    parser.set_defaults(handler=run)


def _describe_plugins(specs: list[str]) -> tuple[list[BackendInfo], list[str]]:
    """Infos of the asked-for plugins, and an error line for each that is not usable."""
    infos: list[BackendInfo] = []
    errors: list[str] = []
    for spec in specs:
        try:
            resolve(spec)
        except ValueError as exc:
            errors.append(str(exc))
            continue
        info = describe_or_report(spec)
        infos.append(info)
        if info.error or not info.importable:
            errors.append(str(info.error or info.import_error))  # each names the backend
    return infos, errors


def report(infos: list[BackendInfo]) -> dict[str, object]:
    return {
        "schema_version": SCHEMA_VERSION,
        "backends": [{**i.as_dict(), "accepts_inference": accepts_inference(i)} for i in infos],
        "engines": [m.as_dict() for m in ENGINE_MODES],
        "plugins": plugin_contract(),
    }


def _engines_text(infos: list[BackendInfo]) -> str:
    taking = [i.name for i in infos if accepts_inference(i)]
    lines = [
        "sampling engines ([inference] table; a backend takes it as inference=: "
        f"{', '.join(taking) or 'none listed'}):"
    ]
    width = max(len(m.selected_by) for m in ENGINE_MODES)
    for m in ENGINE_MODES:
        lines.append(f"  {m.engine:8s} {m.selected_by:{width}s}  {m.runs}")
        lines.append(f"    {capability_flags(m.capabilities)}")
    lines.append(f"  openai: capabilities {OPENAI_PROBED}")
    return "\n".join(lines)


def _text(info: BackendInfo) -> str:
    if info.error:
        status = f"INVALID: {info.error}"
    else:
        status = "ok" if info.importable else f"not importable ({info.import_error})"
    lines = [f"{info.name}  [{info.source}]  {info.target}  -> {status}"]
    if info.extra:
        lines.append(f"  install: pip install 'posttrain[{info.extra}]'")
    if info.error:
        return "\n".join(lines)
    caps = info.capabilities.as_dict()
    flags = [k for k, v in caps.items() if v is True]
    lines.append(f"  capabilities ({info.capabilities_source}): {', '.join(flags) or 'none'}")
    lines.append(f"  devices: {', '.join(info.capabilities.device_kinds) or '-'}")
    takes = accepts_inference(info)
    if takes is not None:
        engines = "any ([inference] -> inference=)" if takes else "its own (no inference= argument)"
        lines.append(f"  sampling engines: {engines}")
    used = [f"{hook} ({part})" for part, hook in info.hooks.items() if hook]
    if used:
        lines.append(f"  hooks: {', '.join(used)}")
    if info.overridden_hooks:
        lines.append(
            f"  hooks overridden: {', '.join(info.overridden_hooks)} (a higher-precedence declaration won)"
        )
    if info.constructor:
        args = [_argument(p) for p in info.constructor]
        lines.append(f"  constructor ([backend] table): {', '.join(args)}")
    calls = (
        ("train", info.train_options),
        ("train_sft", info.train_sft_options),
        ("train_dpo", info.train_dpo_options),
    )
    for call, options in calls:
        lines.append(f"  {call}() options:" + ("" if options else " none declared"))
        for o in options:
            choices = f" {{{', '.join(map(str, o.choices))}}}" if o.choices else ""
            lines.append(f"    {o.name:32s} {o.type:18s} default={o.default!r}{choices}")
            lines.append(f"      {o.description}")
    return "\n".join(lines)


def _argument(p: ParameterSchema) -> str:
    text = p.name + ("" if p.required else f"={p.default!r}")
    choices = p.option.choices if p.option is not None else None
    return text + (f" {{{', '.join(map(str, choices))}}}" if choices else "")


def run(args: argparse.Namespace) -> int:
    plugins, errors = _describe_plugins(args.plugin)
    infos = all_backends() + plugins
    if args.json:
        print(json.dumps(report(infos), indent=2))
    else:
        print("\n\n".join(_text(i) for i in infos))
        print(f"\n{_engines_text(infos)}")
        contract = plugin_contract()
        print(
            f"\nplugins: name one by dotted path ({contract['dotted_path']}) or install it under "
            f"the entry-point group {contract['entry_point_group']!r}; hooks "
            f"{contract['capabilities_hook']}() and {contract['option_schema_hook']}() on the "
            "factory or its module declare what it can do (without them: conservative defaults); "
            f"retrain's hooks are read too. Capabilities come from {contract['precedence']}"
        )
    for error in errors:
        print(f"posttrain backends: error: {error}", file=sys.stderr)
    return 1 if errors else 0
