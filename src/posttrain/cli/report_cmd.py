"""`posttrain report RUN_DIR`: where a run's RL steps spent their time, as a table and as
`time_breakdown.png` beside the run's reward curve (`jobs.breakdown`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `report` on the `posttrain` command."""
    parser = subparsers.add_parser(
        "report",
        help="a run's per-phase time breakdown, staleness and throughput, with a plot",
        description=(
            "Print where a run's RL steps spent their time (waiting for rollouts, training, "
            "the engine's weight sync; sampling beside them), the staleness of the tokens "
            "trained and the tokens per second, from the run's history.jsonl; and plot each "
            "step's phases to time_breakdown.png in the run directory, beside curve.png. "
            "RUN_DIR is the run directory the job printed (<output_dir>/<project>/models/"
            "<name>/)."
        ),
    )
    parser.add_argument("run_dir", type=Path, help="the run directory the job printed")
    parser.add_argument("--no-plot", action="store_true", help="print the table only")
    parser.set_defaults(handler=run_report)


def run_report(args: argparse.Namespace) -> int:
    from posttrain.jobs.breakdown import PLOT, find_history, plot_breakdown, read_breakdown, table

    try:
        history = find_history(args.run_dir)
        breakdown = read_breakdown(history)
    except (FileNotFoundError, ValueError) as err:
        print(f"posttrain report: error: {err}", file=sys.stderr)
        return 2
    print(table(breakdown))
    if not args.no_plot:
        run_dir = history.parent
        title = f"{run_dir.parent.parent.name}/{run_dir.name}: time per RL step"
        print(f"plot: {plot_breakdown(breakdown, run_dir / PLOT, title)}")
    return 0
