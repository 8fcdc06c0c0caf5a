"""`posttrain export RUN_DIR [--step N] OUT_DIR`: a trained checkpoint as a Hugging Face model
directory (merged weights or a PEFT adapter; see docs/export.md)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `export` on the `posttrain` command."""
    parser = subparsers.add_parser(
        "export",
        help="write a trained checkpoint as a Hugging Face model directory (merged or adapter)",
        description=(
            "Write the checkpoint of a run to OUT_DIR as a Hugging Face model directory: "
            "safetensors weights, config, tokenizer, chat template and generation config, plus "
            "posttrain_export.json (where it came from). A LoRA run is merged into the base "
            "weights (W = W0 + alpha/r * B A) unless --adapter asks for the PEFT adapter; a full "
            "fine-tuning run is written as its weights. RUN_DIR is the directory a run printed "
            "(holding models/<name>/) or a model directory (model.json, checkpoints/<step>/); "
            "a Tinker run's checkpoint is fetched from the service through the tinker SDK. "
            "See docs/export.md."
        ),
    )
    parser.add_argument(
        "run_dir",
        help="run directory, model directory, or a tinker:// checkpoint path (with --base-url)",
    )
    parser.add_argument("out_dir", type=Path, help="the new model directory")
    parser.add_argument(
        "--step", type=int, default=None, help="the checkpoint's step (default: the latest)"
    )
    parser.add_argument(
        "--model", default=None, metavar="NAME", help="which model, when RUN_DIR holds several"
    )
    form = parser.add_mutually_exclusive_group()
    form.add_argument(
        "--merge",
        dest="mode",
        action="store_const",
        const="merge",
        help="merge the LoRA adapter into the base weights (the default)",
    )
    form.add_argument(
        "--adapter",
        dest="mode",
        action="store_const",
        const="adapter",
        help="write the PEFT adapter (PeftModel.from_pretrained(base, OUT_DIR)) instead",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="the weights' dtype (default: the base model's)",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing OUT_DIR")
    parser.add_argument(
        "--base-url",
        default=None,
        metavar="URL",
        help="the Tinker service of a tinker:// path or a TinkerBackend model (default: "
        "$TINKER_BASE_URL; the key is $TINKER_API_KEY)",
    )
    parser.set_defaults(handler=run_export, mode=None)


def run_export(args: argparse.Namespace) -> int:
    # Imported here so `posttrain --help` does not pay for importing torch.
    from posttrain.backends.export import export_model

    began = time.perf_counter()
    try:
        result = export_model(
            args.run_dir,
            args.out_dir,
            step=args.step,
            model=args.model,
            mode=args.mode,
            dtype=args.dtype,
            force=args.force,
            base_url=args.base_url,
        )
    except (FileNotFoundError, FileExistsError, ValueError, ImportError) as err:
        print(f"posttrain export: error: {err}", file=sys.stderr)
        return 2
    for note in result.notes:
        print(f"note: {note}")
    # A tinker:// path names its checkpoint, not a step.
    what = result.source if result.step is None else f"step {result.step} of {result.source}"
    print(
        f"exported {what} ({result.form}, {result.dtype}) to {result.path} "
        f"in {time.perf_counter() - began:.2f}s"
    )
    return 0
