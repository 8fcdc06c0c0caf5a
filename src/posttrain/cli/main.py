"""The `posttrain` command line: one subcommand per job."""

from __future__ import annotations

import argparse
import sys

from posttrain.cli import backends_cmd, doctor_cmd, explain_cmd, serve_cmd, tiny_cmd, train_cmd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    train_cmd.add_parsers(subparsers)
    tiny_cmd.add_parser(subparsers)
    backends_cmd.add_parser(subparsers)
    doctor_cmd.add_parser(subparsers)
    explain_cmd.add_parser(subparsers)
    serve_cmd.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    return int(handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
