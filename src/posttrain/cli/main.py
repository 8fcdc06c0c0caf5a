"""The `posttrain` command line: one subcommand per job."""

from __future__ import annotations

import argparse
import sys

from posttrain.cli import (
    backends_cmd,
    doctor_cmd,
    explain_cmd,
    export_cmd,
    models_cmd,
    report_cmd,
    serve_cmd,
    tiny_cmd,
    train_cmd,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    train_cmd.add_parsers(subparsers)
    tiny_cmd.add_parser(subparsers)
    models_cmd.add_parsers(subparsers)
    backends_cmd.add_parser(subparsers)
    doctor_cmd.add_parser(subparsers)
    explain_cmd.add_parser(subparsers)
    serve_cmd.add_parser(subparsers)
    export_cmd.add_parser(subparsers)
    report_cmd.add_parser(subparsers)
    return parser


# Commands that compute with torch: its thread count is set from the usable cores before they
# start (`posttrain serve` sets it itself, after its cheap checks). Not at import time:
# importing posttrain changes nothing.
COMPUTE_COMMANDS = frozenset(
    {"train", "demo", "make-tiny-model", "explain", "import-model", "fetch-model", "export"}
)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    if args.command in COMPUTE_COMMANDS:
        from posttrain.engine.threads import configure_torch_threads

        try:
            configure_torch_threads()
        except ValueError as err:  # a bad OMP_NUM_THREADS / POSTTRAIN_NUM_THREADS
            print(f"posttrain {args.command}: {err}", file=sys.stderr)
            return 2
    return int(handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
