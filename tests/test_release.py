"""The release's own files: a CHANGELOG entry for the version being built."""

from __future__ import annotations

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
