"""Progress of long loops: lines with a rate and an ETA every interval, or a tqdm bar."""

from __future__ import annotations

import re

import pytest

from posttrain.trainer import progress
from posttrain.trainer.progress import Progress, duration, report_progress

LINE = re.compile(
    r"^train_sft: (\d+)/4 updates \((\d+)%\)  [\d.e+]+ (updates/s|s/update)  "
    r"elapsed \d+s  eta \d+s  loss [\d.]+$"
)


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [(0.4, "0s"), (59.4, "59s"), (61, "1m01s"), (3599, "59m59s"), (3660, "1h01m"),
     (float("inf"), "?")],
)  # fmt: skip
def test_duration(seconds, shown):
    assert duration(seconds) == shown


def test_lines_every_interval_with_rate_and_eta():
    lines: list[str] = []
    with (
        report_progress(lines.append, bar=False, interval_s=0.0),
        Progress("train_sft", 4, "update") as shown,
    ):
        for loss in (2.0, 1.5, 1.25, 1.0):
            shown.update(loss=loss)
    assert len(lines) == 4
    for count, line in enumerate(lines, 1):
        match = LINE.match(line)
        assert match, line
        assert int(match[1]) == count and int(match[2]) == 25 * count
    # The rate and ETA arithmetic, on fixed numbers: 3 of 4 done in 6 s is 2 s/update, 2 s left.
    shown.done = 3
    assert "  2 s/update  elapsed 6s  eta 2s" in shown.line(6.0, {})
    shown.done = 4
    assert "  2 updates/s  elapsed 2s  eta 0s" in shown.line(2.0, {})


def test_no_line_within_the_interval():
    lines: list[str] = []
    with (
        report_progress(lines.append, bar=False, interval_s=3600.0),
        Progress("train", 3, "update") as shown,
    ):
        for _ in range(3):
            shown.update()
    assert lines == []


def test_a_bar_on_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr(progress, "BAR_DELAY_S", 0.0)  # else a bar waits 2 s before it shows
    with report_progress(bar=True), Progress("train_sft", 3, "update") as shown:
        for _ in range(3):
            shown.update(loss=0.5)
    err = capsys.readouterr().err  # tqdm redraws at most every 0.1 s: the first frame at least
    assert "train_sft:" in err and "/3 [" in err and "update/s" in err
