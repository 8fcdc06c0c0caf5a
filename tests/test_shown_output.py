"""The rules by which a docs page's output block matches what its code printed."""

from __future__ import annotations

import pytest

from shown_output import mismatch

REPORT = "phase      total s   share\ntrain        ~0.814   ~80.6%\nsync: 1,299,144 bytes\n"


@pytest.mark.parametrize(
    ("shown", "printed"),
    [
        ("step 1: reward 0.50\n", "step 1: reward 0.50\n"),
        ("step 1: reward 0.50\n", "step 1: reward 0.50   \n\n"),  # trailing blanks aside
        (REPORT, "phase      total s   share\ntrain   12.031  100.0%\nsync: 1,299,144 bytes\n"),
        ("loss ~+0.0123\n", "loss -1.5e-06\n"),
        ("path: ...\n", "path: /any/where/it/is\n"),
        ("first\n...\nlast\n", "first\nlast\n"),  # a line of ... matches no line too
        ("first\n...\nlast\n", "first\na\nb\nlast\n"),
    ],
)
def test_matches(shown: str, printed: str):
    assert mismatch(shown, printed) is None


@pytest.mark.parametrize(
    ("shown", "printed"),
    [
        ("step 1: reward 0.50\n", "step 1: reward 0.51\n"),  # a number without ~ is exact
        ("loss ~0.5\n", "loss n/a\n"),  # ~ stands for a number, not for any text
        (REPORT, REPORT.replace("1,299,144", "0")),
        ("a b\n", "ab\n"),  # a run of spaces needs at least one space
        ("first\n...\nlast\n", "first\nlast\nmore\n"),  # the whole output, not a prefix
        ("path: ...\n", "path: x\ny\n"),  # ... within a line stays within it
    ],
)
def test_mismatches(shown: str, printed: str):
    diff = mismatch(shown, printed)
    assert diff is not None and (diff.startswith("line ") or diff.startswith("--- shown"))


def test_a_mismatch_names_the_lines_that_differ():
    shown = "step 1: loss ~+0.0350, ~0.12s\nstep 2: loss ~-0.0349, ~0.11s\n"
    printed = "step 1: loss +0.0350, 0.20s\nstep 2: loss     n/a, 0.10s\n"
    assert mismatch(shown, printed) == (
        "line 2: shown   step 2: loss ~-0.0349, ~0.11s\n        printed step 2: loss     n/a, 0.10s"
    )
