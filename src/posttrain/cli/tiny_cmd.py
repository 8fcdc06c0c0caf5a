"""`posttrain make-tiny-model DIR [--gguf FILE]`: write a randomly initialised tiny model and
tokenizer, and optionally the same model as a GGUF file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# models.tiny.Size and Arch, spelled out so `posttrain --help` does not import torch and
# transformers.
SIZES = ("tiny", "mini", "small", "qwen2.5-0.5b", "llama3.2-1b", "qwen3-0.6b", "qwen3.5-0.8b")
ARCHES = ("qwen2", "llama", "qwen3", "qwen3_5", "gemma3", "olmo3")


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `make-tiny-model` on the `posttrain` command."""
    parser = subparsers.add_parser(
        "make-tiny-model",
        help="write a random causal LM with a byte-level tokenizer to DIR (no download)",
        description=(
            "Write a randomly initialised causal LM and its byte-level tokenizer (chat "
            "template) to DIR. The test sizes have 260 tokens; qwen2.5-0.5b, llama3.2-1b, "
            "qwen3-0.6b and qwen3.5-0.8b (its text model, hybrid) are the published "
            "architectures with their vocabulary sizes (151936, 128256, 151936, 248320). "
            "The same seed gives the same weights."
        ),
    )
    parser.add_argument("dir", type=Path, help="output directory (created if missing)")
    parser.add_argument(
        "--arch",
        choices=ARCHES,
        default=None,
        help="default: qwen2 for the test sizes, the published one for a real size; qwen3_5 "
        "is hybrid (linear-attention and full-attention layers), gemma3 and olmo3 have "
        "sliding-window layers (a 16-token window in the test sizes)",
    )
    parser.add_argument(
        "--size",
        choices=SIZES,
        default="tiny",
        help="tiny: ~108K parameters; mini: ~511K; small: ~30M; qwen2.5-0.5b: 494M; "
        "llama3.2-1b: 1.24B; qwen3-0.6b: 596M; qwen3.5-0.8b: 752M (real sizes take seconds "
        "to a minute and 1-2.5 GB of disk)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    parser.add_argument(
        "--tied",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="tie the unembedding to the input embedding (default: untied for the test sizes, "
        "as published for a real size)",
    )
    parser.add_argument(
        "--gguf",
        type=Path,
        metavar="FILE",
        help="also write the model as GGUF file FILE, a base model like any .gguf file "
        "(llama, the default with --gguf; sizes tiny, mini, small; needs the gguf package: "
        "pip install 'posttrain[gguf]')",
    )
    parser.set_defaults(handler=run_make_tiny_model)


def run_make_tiny_model(args: argparse.Namespace) -> int:
    # Imported here so `posttrain --help` does not pay for importing transformers.
    from posttrain.models.tiny import make_tiny_model

    try:
        path = make_tiny_model(
            args.dir, arch=args.arch, size=args.size, seed=args.seed, tied=args.tied, gguf=args.gguf
        )
    except (ValueError, ImportError) as err:  # a size or architecture refused; gguf missing
        print(f"posttrain make-tiny-model: error: {err}", file=sys.stderr)
        return 2
    print(path)
    if args.gguf is not None:
        print(args.gguf)
    return 0
