"""`posttrain make-tiny-model DIR`: write a randomly initialised tiny model and tokenizer."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `make-tiny-model` on the `posttrain` command."""
    parser = subparsers.add_parser(
        "make-tiny-model",
        help="write a random tiny causal LM with a byte-level tokenizer to DIR (no download)",
        description=(
            "Write a randomly initialised causal LM and its byte-level tokenizer (260 tokens, "
            "chat template) to DIR. The same seed gives the same weights."
        ),
    )
    parser.add_argument("dir", type=Path, help="output directory (created if missing)")
    parser.add_argument("--arch", choices=("qwen2", "llama"), default="qwen2")
    parser.add_argument(
        "--size",
        choices=("tiny", "mini", "small"),
        default="tiny",
        help="tiny: ~108K parameters; mini: ~511K; small: ~30M",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    parser.set_defaults(handler=run_make_tiny_model)


def run_make_tiny_model(args: argparse.Namespace) -> int:
    # Imported here so `posttrain --help` does not pay for importing transformers.
    from posttrain.engine.tiny import make_tiny_model

    path = make_tiny_model(args.dir, arch=args.arch, size=args.size, seed=args.seed)
    print(path)
    return 0
