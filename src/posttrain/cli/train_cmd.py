"""`posttrain train CONFIG.toml [--resume DIR [--resume-step N]]` and `posttrain demo [TASK]`,
each with `--set TABLE.KEY=VALUE` to change a key of the job for this run."""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from posttrain.jobs.config import JobConfig

# The shipped example configs; word-problems trains a real model (SmolLM2-135M-Instruct).
EXAMPLES = ("reverse", "addition", "word-problems", "gemma3-word-problems")
FLAGSHIP = "reverse"


def add_parsers(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `train` and `demo` on the `posttrain` command."""
    train = subparsers.add_parser(
        "train",
        help="run an SFT warm-up + RL job described by a TOML file",
        description="Run an SFT warm-up + RL job described by a TOML file.",
    )
    train.add_argument("config", type=Path, help="the job's TOML file (see `posttrain demo`'s)")
    train.add_argument(
        "--resume",
        type=Path,
        metavar="DIR",
        help="continue the run in DIR (<output_dir>/<project>/models/<name>) from its last checkpoint",
    )
    train.add_argument(
        "--resume-step",
        type=int,
        metavar="N",
        help="with --resume: continue from the checkpoint of step N (DIR/checkpoints/N; 0 with "
        "no such checkpoint: the base model) instead of the latest, which a damaged latest "
        "checkpoint needs; the checkpoints after N are moved aside, not deleted",
    )
    _add_set(train)
    _add_debug(train)
    train.set_defaults(handler=run_train)
    demo = subparsers.add_parser(
        "demo",
        help=f"the flagship example: {FLAGSHIP} on a tiny model, SFT warm-up then RL, on CPU",
        description="Run a shipped example config; its run goes under ./runs/.",
    )
    demo.add_argument("task", nargs="?", default=FLAGSHIP, choices=EXAMPLES)
    demo.add_argument(
        "--print-config",
        action="store_true",
        help="print the config, with the --set changes written in, and exit",
    )
    _add_set(demo)
    _add_debug(demo)
    demo.set_defaults(handler=run_demo)


def _add_set(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="TABLE.KEY=VALUE",
        help="change one key of the job for this run, as the TOML file would set it "
        "(repeatable): --set rl.steps=20 --set run.name=short",
    )


def _add_debug(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--debug",
        action="store_true",
        help="on an error, raise it with its full traceback instead of printing one line",
    )


def example_config(task: str) -> Path:
    """Path of the example config shipped with the package for `task`."""
    path = Path(str(resources.files("posttrain") / "examples" / f"{task}.toml"))
    if not path.is_file():
        raise FileNotFoundError(f"example config {path} is missing from the installed package")
    return path


def run_train(args: argparse.Namespace) -> int:
    from posttrain.jobs.config import load_config

    try:
        config = load_config(args.config, args.set)
    except (ValueError, FileNotFoundError) as exc:
        if args.debug:
            raise
        print(f"posttrain train: error: {exc}", file=sys.stderr)
        return 2
    if args.resume_step is not None and args.resume is None:
        print("posttrain train: error: --resume-step needs --resume DIR", file=sys.stderr)
        return 2
    return _run(config, args.resume, args.resume_step, debug=args.debug)


def run_demo(args: argparse.Namespace) -> int:
    from posttrain.jobs.config import load_config

    path = example_config(args.task)
    try:
        config = load_config(path, args.set)
    except ValueError as exc:  # a --set key or value the job refuses
        print(f"posttrain demo: error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:  # the job this command would run: the file with --set written in
        from posttrain.jobs.tables import toml_with_overrides

        print(toml_with_overrides(path.read_text(), args.set), end="")
        return 0
    # A fresh run each time: the next free name, never overwriting an earlier demo.
    base, name, index = (
        Path(config.run.output_dir) / config.run.project / "models",
        config.run.name,
        1,
    )
    while (base / name).exists():
        index += 1
        name = f"{config.run.name}-{index}"
    print(f"posttrain demo: {path}")
    return _run(replace(config, run=replace(config.run, name=name)), None, debug=args.debug)


def _job_errors() -> tuple[type[Exception], ...]:
    """What a job stops on that is no crash of posttrain's: a bad config or input, the engine
    failing the parity check, the hub, an OpenAI server or an engine process that fails. Each
    message names the cause and the fix (an engine process's has its log's tail), so it is one
    line and exit code 2; anything else is a bug and keeps its traceback."""
    from posttrain.inference.openai_engine import OpenAIServerError
    from posttrain.inference.process import EngineProcessError
    from posttrain.models.cache import HubUnreachableError
    from posttrain.trainer.parity import ParityError

    return (
        ValueError,
        FileNotFoundError,
        ImportError,
        ParityError,
        HubUnreachableError,
        OpenAIServerError,
        EngineProcessError,
    )


def _run(
    config: JobConfig, resume: Path | None, resume_step: int | None = None, *, debug: bool = False
) -> int:
    """Run the job; a job error is printed as one line (`_job_errors`), or raised with `debug`."""
    from transformers.utils import logging as hf_logging

    from posttrain.jobs.backend import JobPreflightError
    from posttrain.jobs.train_job import run_job

    # A checkpoint per step would otherwise print a "Writing model shards" bar per step.
    hf_logging.disable_progress_bar()
    try:
        # run_job runs the job's preflight before any work: a refused configuration costs nothing.
        asyncio.run(run_job(config, resume=resume, resume_step=resume_step))
    except JobPreflightError as exc:
        if debug:
            raise
        for problem in exc.problems:
            print(f"posttrain train: preflight: {problem}", file=sys.stderr)
        return 2
    except _job_errors() as exc:
        if debug:
            raise
        print(f"posttrain train: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "\ninterrupted; continue with --resume and the run directory printed above",
            file=sys.stderr,
        )
        return 130
    return 0
