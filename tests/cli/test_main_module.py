"""`python -m posttrain` runs the command line (it failed: the package had no __main__)."""

from __future__ import annotations

import runpy
import subprocess
import sys

import pytest


@pytest.mark.slow  # a second interpreter imports torch and transformers: seconds
def test_python_dash_m_posttrain_runs_the_cli():
    shown = subprocess.run(
        [sys.executable, "-m", "posttrain", "--help"], capture_output=True, text=True, timeout=120
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("usage: posttrain") and "explain" in shown.stdout


def test_its_exit_status_is_the_commands(tmp_path, monkeypatch, capsys):
    """In-process (a second interpreter costs seconds of imports): 2 for an unreadable config."""
    monkeypatch.setattr(sys, "argv", ["posttrain", "explain", str(tmp_path / "missing.toml")])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("posttrain", run_name="__main__")
    assert exited.value.code == 2
    assert "posttrain explain: error:" in capsys.readouterr().err
