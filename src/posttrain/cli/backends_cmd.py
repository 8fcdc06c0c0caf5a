"""`posttrain backends [--json]`: every backend, its dependencies, capabilities and options."""

from __future__ import annotations

import argparse
import json

from posttrain.backends.registry import BackendInfo, all_backends, describe

SCHEMA_VERSION = 1


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("backends", help="list backends with capabilities and options")
    parser.add_argument("--json", action="store_true", help="machine-readable output (schema v1)")
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="PKG.MODULE:CLASS",
        help="also describe this plugin backend (repeatable)",
    )
    parser.set_defaults(handler=run)


def report(plugins: list[str]) -> dict[str, object]:
    infos = all_backends() + [describe(p) for p in plugins]
    return {"schema_version": SCHEMA_VERSION, "backends": [i.as_dict() for i in infos]}


def _text(info: BackendInfo) -> str:
    status = "ok" if info.importable else f"not importable ({info.import_error})"
    lines = [f"{info.name}  [{info.source}]  {info.target}  -> {status}"]
    if info.extra:
        lines.append(f"  install: pip install 'posttrain[{info.extra}]'")
    caps = info.capabilities.as_dict()
    flags = [k for k, v in caps.items() if v is True]
    lines.append(f"  capabilities ({info.capabilities_source}): {', '.join(flags) or 'none'}")
    lines.append(f"  devices: {', '.join(info.capabilities.device_kinds) or '-'}")
    for call, options in (("train", info.train_options), ("train_sft", info.train_sft_options)):
        lines.append(f"  {call}() options:")
        for o in options:
            choices = f" {{{', '.join(map(str, o.choices))}}}" if o.choices else ""
            lines.append(f"    {o.name:32s} {o.type:18s} default={o.default!r}{choices}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    data = report(args.plugin)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    infos = all_backends() + [describe(p) for p in args.plugin]
    print("\n\n".join(_text(i) for i in infos))
    return 0
