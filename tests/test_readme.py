"""Every python example in README.md runs (on a tiny model, in a temporary directory)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.slow
def test_readme_examples_run(tmp_path):
    tiny = tmp_path / "tiny"
    # Blocks run in order in one process, as a reader would paste them.
    script = "\n".join(block.replace("/tmp/tiny", str(tiny)) for block in BLOCKS)
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / ".posttrain" / "demo" / "models" / "agent-001" / "history.jsonl").exists()
