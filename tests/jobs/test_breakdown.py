"""`posttrain report RUN_DIR` (`jobs.breakdown`): a run's per-phase time table, staleness and
throughput from its history.jsonl, and the plot beside its reward curve."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
from test_async_rl import _job

from posttrain.cli.main import main
from posttrain.jobs.breakdown import PLOT, read_breakdown, table
from posttrain.jobs.train_job import run_job


def _rl_row(step: int, sample: float, wait: float, train: float, sync: float, total: float,
            stale: float, sampled: float, trained: float) -> dict[str, object]:  # fmt: skip
    return {
        "step": step,
        "split": "train",
        "time/sample_s": sample,
        "time/wait_for_rollouts_s": wait,
        "time/train_s": train,
        "time/sync_s": sync,
        "time/step_s": total,
        "staleness/max": math.ceil(stale),
        "staleness/mean": stale,
        "tokens/sampled": sampled,
        "tokens/trained": trained,
        "sync/bytes": 10.0,
        "sync/version": float(step),
    }


def test_the_breakdown_adds_up_by_hand(tmp_path: Path):
    first = dict(sample=0.5, wait=0.5, train=1.0, sync=0.25, total=2.0, stale=0.0)
    second = dict(sample=1.0, wait=0.0, train=1.5, sync=0.25, total=2.0, stale=0.5)
    rows = [
        {"step": 1, "split": "train", "loss": 0.5},  # an SFT warm-up's row: no step times
        _rl_row(2, **first, sampled=100.0, trained=100.0),
        {"step": 2, "split": "val", "accuracy": 1.0},
        _rl_row(3, **second, sampled=50.0, trained=300.0),
    ]
    history = tmp_path / "history.jsonl"
    history.write_text("".join(json.dumps(r) + "\n" for r in rows))
    breakdown = read_breakdown(history)
    assert breakdown.steps == [2, 3]
    # other = step - wait - train - sync: 2 - 0.5 - 1 - 0.25 and 2 - 0 - 1.5 - 0.25.
    assert breakdown.phases["other"] == [0.25, 0.25]
    totals = {p: breakdown.total(p) for p in ("wait_for_rollouts", "train", "sync", "other")}
    assert totals == {"wait_for_rollouts": 0.5, "train": 2.5, "sync": 0.5, "other": 0.5}
    assert breakdown.share("train") == 2.5 / 4.0 and breakdown.share("sample") == 1.5 / 4.0
    assert breakdown.staleness_max == 1.0
    assert breakdown.staleness_mean == (0.0 * 100 + 0.5 * 300) / 400  # token-weighted: 0.375
    assert breakdown.sampled_tokens_per_s == 150 / 1.5  # all sampled tokens / sampling seconds
    assert breakdown.trained_tokens_per_s == 400 / 2.5
    assert breakdown.sync_bytes == 20.0 and breakdown.sync_version == 3.0
    text = table(breakdown).splitlines()
    assert text[0] == "time breakdown over 2 RL steps (model steps 2-3)"
    assert text[3] == "train                     2.500        1.250   62.5%"
    assert text[6] == "step                      4.000        2.000  100.0%"
    assert text[7] == "sample (beside)           1.500        0.750   37.5%"
    assert "staleness: max 1, mean 0.38 (model steps, token-weighted)" in text
    assert "throughput: 100 sampled tokens/s (over sampling time), 160 trained tokens/s " \
        "(over training time)" in text  # fmt: skip


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-step job one step off-policy on the tiny model, done."""
    config = _job(tmp_path_factory.mktemp("report"), max_off_policy_steps=1)
    return asyncio.run(run_job(config, echo=lambda line: None)).run_dir


def test_report_prints_the_runs_phases_and_plots_them(
    finished_run: Path, capsys: pytest.CaptureFixture[str]
):
    assert main(["report", str(finished_run)]) == 0
    out = capsys.readouterr().out.splitlines()
    history = [json.loads(x) for x in (finished_run / "history.jsonl").read_text().splitlines()]
    rl = [r for r in history if r["split"] == "train"]
    assert len(rl) == 3

    def total(key: str) -> float:
        return math.fsum(r[key] for r in rl)

    step = total("time/step_s")
    other = math.fsum(
        r["time/step_s"] - r["time/wait_for_rollouts_s"] - r["time/train_s"] - r["time/sync_s"]
        for r in rl
    )
    expected = {
        "wait_for_rollouts": total("time/wait_for_rollouts_s"),
        "train": total("time/train_s"),
        "sync": total("time/sync_s"),
        "other": other,
        "step": step,
        "sample (beside)": total("time/sample_s"),
    }
    printed = {line[:20].strip(): line[20:].split() for line in out[2:8]}
    assert printed.keys() == expected.keys()
    for phase, seconds in expected.items():
        shown = printed[phase]
        assert shown == [f"{seconds:.3f}", f"{seconds / 3:.3f}", f"{seconds / step:.1%}"]
    # Steps 2 and 3 train on tokens one step old, step 1 on fresh ones: weighted by tokens.
    tokens = [r["tokens/trained"] for r in rl]
    mean = (tokens[1] + tokens[2]) / sum(tokens)
    assert f"staleness: max 1, mean {mean:.2f} (model steps, token-weighted)" in out
    assert out[-1] == f"plot: {finished_run / PLOT}"
    png = (finished_run / PLOT).read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert sorted(p.name for p in finished_run.glob("*.png")) == ["curve.png", PLOT]  # no temp


def test_report_finds_the_run_under_its_project_directory(
    finished_run: Path, capsys: pytest.CaptureFixture[str]
):
    assert main(["report", str(finished_run.parent.parent), "--no-plot"]) == 0
    assert capsys.readouterr().out.startswith("time breakdown over 3 RL steps")


def test_report_refuses_what_is_not_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path} is not a run directory: expected <output_dir>/<project>/models/" in err
    (tmp_path / "history.jsonl").write_text(json.dumps({"step": 0, "split": "val"}) + "\n")
    assert main(["report", str(tmp_path)]) == 2
    assert "has no RL step with time/step_s" in capsys.readouterr().err
    assert not (tmp_path / PLOT).exists()
