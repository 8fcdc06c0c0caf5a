"""`posttrain backends`: bad plugins and names are clear errors with a non-zero exit, never a
traceback; run both in-process and as the real command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.cli.main import main

PLUGINS = Path(__file__).parents[1] / "backends"


@pytest.fixture(autouse=True)
def plugin_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))


@pytest.mark.parametrize(
    ("plugin", "message"),
    [
        (
            "plugin_example:BrokenBackend",
            "plugin_example:BrokenBackend: posttrain_capabilities() returned malformed "
            "capabilities: missing keys ['device_kinds', 'preserves_token_advantages'",
        ),
        (
            "locl",
            "unknown backend 'locl'; known backends: local, ray, tinker. Did you mean 'local'?",
        ),
        (
            "no_such_pkg.backends:Mine",
            "cannot import module 'no_such_pkg.backends' for backend 'no_such_pkg.backends:Mine': "
            "ModuleNotFoundError: No module named 'no_such_pkg'",
        ),
        ("plugin_example:Nope", "module 'plugin_example' has no attribute 'Nope'"),
        ("plugin_example:", "is not a dotted path; write it as 'package.module:ClassName'"),
        (
            "plugin_example:RaisingBackend",
            "posttrain_option_schema() raised RuntimeError: schema server unreachable",
        ),
    ],
)
@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_bad_plugins_exit_1_with_the_reason(plugin, message, json_flag, capsys):
    assert main(["backends", "--plugin", plugin, *json_flag]) == 1
    captured = capsys.readouterr()
    assert "posttrain backends: error: " in captured.err and message in captured.err
    assert "Traceback" not in captured.out + captured.err
    assert (
        "local  [builtin]" in captured.out or '"name": "local"' in captured.out
    )  # the rest still listed


def test_good_plugins_exit_0(capsys):
    assert (
        main(
            [
                "backends",
                "--plugin",
                "plugin_example:HookedBackend",
                "--plugin",
                "plugin_example:PlainBackend",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "plugin_example:HookedBackend  [plugin]" in out and "capabilities (hook)" in out
    assert (
        "plugin_example:PlainBackend  [plugin]" in out
        and "capabilities (default): resume_runtime_dependent" in out
    )


@pytest.mark.slow
def test_the_real_command_reports_without_a_traceback():
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(PLUGINS), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "posttrain.cli.main",
            "backends",
            "--plugin",
            "plugin_example:BrokenBackend",
            "--plugin",
            "locl",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert "malformed capabilities" in done.stderr and "unknown backend 'locl'" in done.stderr
