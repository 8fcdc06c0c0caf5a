"""The release's own files: a CHANGELOG entry for the version being built, and the release check
(scripts/release-check: build, install the wheel in a fresh venv, run it outside the repository)
run by CI. The script itself is the real check; it takes minutes, so it runs in .ci/run, not here."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[1]


def version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_the_changelog_starts_with_the_current_version():
    headings = re.findall(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    assert headings, "CHANGELOG.md has no '## VERSION' heading"
    assert headings[0] == version(), f"newest first: {headings[0]} is not {version()}"
    assert len(set(headings)) == len(headings), headings


def test_ci_runs_the_release_check():
    script = ROOT / "scripts" / "release-check"
    assert script.is_file() and os.access(script, os.X_OK)
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "bash scripts/release-check" in ci
