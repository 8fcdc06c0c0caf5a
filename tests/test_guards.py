"""Guards on the repository itself: small modules, and no path of the machine that wrote it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 500  # shared/STYLE.md: "over ~500 is a design smell"


def tracked_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    return [ROOT / name for name in listed.split("\0") if name]


def test_no_module_is_over_500_lines():
    too_long = {
        str(path.relative_to(ROOT)): n
        for path in (ROOT / "src" / "posttrain").rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not too_long, f"split these modules (lines): {too_long}"


def test_no_tracked_file_names_this_machines_paths():
    # The checkout's own absolute path and the home directory stand for "a path of this
    # machine": whatever machine runs the test, neither belongs in the repository.
    machine_paths = {str(ROOT), str(Path.home())} - {"/"}
    found = []
    for path in tracked_files():
        try:
            text = path.read_text()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary (a PNG) or deleted in the working tree
        found += [
            f"{path.relative_to(ROOT)}: {p}"
            for p in machine_paths
            if re.search(re.escape(p) + r"(?![\w.-])", text)  # the path, not a longer name
        ]
    assert not found, f"absolute paths of this machine in the repository: {found}"
