"""`posttrain explain CONFIG [--json]`: the resolved job, its backend, preflight and plan."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

from posttrain.backends.preflight import PreflightError, preflight_rl, preflight_sft
from posttrain.backends.registry import describe
from posttrain.jobs.config import JobConfig, load_config


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("explain", help="show a job's resolved config, backend and plan")
    parser.add_argument("config", type=Path, help="the job's TOML file")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(handler=run)


def _jsonable(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def plan(config: JobConfig) -> dict[str, int]:
    """Step counts and batch shape the job will run."""
    sft = config.sft.trainer
    examples = config.sft.examples
    sft_steps = math.ceil(examples / sft.batch_size) * sft.epochs if examples else 0
    completions = config.rl.prompts_per_step * config.rl.group_size
    return {
        "sft_examples": examples,
        "sft_optimizer_steps": sft_steps,
        "rl_steps": config.rl.steps,
        "rl_prompts_per_step": config.rl.prompts_per_step,
        "rl_group_size": config.rl.group_size,
        "rl_completions_per_step": completions,
        "rl_max_sampled_tokens_per_step": completions * config.rl.max_tokens,
        "rl_optimizer_steps_per_step": config.rl.trainer.num_minibatches,
        "held_out_problems": config.eval.held_out,
    }


def explain(config: JobConfig) -> dict[str, object]:
    info = describe(config.run.backend)
    problems: list[dict[str, str]] = []
    name = info.target.rpartition(":")[2]
    try:
        preflight_rl(name, info.capabilities, config.rl.trainer)
    except PreflightError as exc:
        problems += [{"call": "train", "option": p.option, "message": p.message} for p in exc.problems]
    if config.sft.examples or config.sft.dataset:
        try:
            preflight_sft(name, info.capabilities, config.sft.trainer)
        except PreflightError as exc:
            problems += [{"call": "train_sft", "option": p.option, "message": p.message} for p in exc.problems]
    return {
        "config": _jsonable(config),
        "backend": {
            "name": info.name,
            "target": info.target,
            "importable": info.importable,
            "capabilities": info.capabilities.as_dict(),
        },
        "preflight": {"ok": not problems, "problems": problems},
        "plan": plan(config),
    }


def _print_table(title: str, rows: dict[str, object], indent: str = "  ") -> None:
    print(title)
    for key, value in rows.items():
        if isinstance(value, dict):
            _print_table(f"{indent}{key}:", value, indent + "  ")  # type: ignore[arg-type]
        else:
            print(f"{indent}{key} = {value!r}")


def run(args: argparse.Namespace) -> int:
    report = explain(load_config(args.config))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(f"config ({args.config}):", report["config"])  # type: ignore[arg-type]
        _print_table("backend:", report["backend"])  # type: ignore[arg-type]
        preflight = report["preflight"]
        assert isinstance(preflight, dict)
        print("preflight: ok" if preflight["ok"] else "preflight: problems")
        for p in preflight["problems"]:
            print(f"  - {p['call']}() {p['option']}: {p['message']}")
        _print_table("plan:", report["plan"])  # type: ignore[arg-type]
    return 0 if report["preflight"]["ok"] else 1  # type: ignore[index]
