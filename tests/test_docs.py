"""Every example in docs/ runs: the python blocks of each page in order in one process (on a
tiny model, in a temporary directory, against a real `posttrain serve` where a page uses one),
and the `posttrain` commands of its bash blocks (all but `serve`, which a page's python uses).
A page that names `tiny.gguf` finds that file (the tiny llama model as GGUF) in its directory,
and a cache of its own ($POSTTRAIN_CACHE).

A block whose info string names a file (```toml file=job.toml```) is that file's content: it
is written into the directory before the page's python blocks run, and before its commands."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from gguf_files import write_tiny_gguf
from posttrain.engine.tiny import make_tiny_model

ROOT = Path(__file__).parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md"))
SERVER_URL = "http://127.0.0.1:8000"  # where a page's python expects `posttrain serve`
SERVER_KEY = "tml-mykey"

# The server tests' helper starts `posttrain serve` on a free port (tests/ is not a package).
sys.path.insert(0, str(ROOT / "tests" / "server"))
from serve_helpers import start_server  # noqa: E402  # pyright: ignore[reportMissingImports]


def blocks(page: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", page.read_text(), flags=re.S)


def write_files(page: Path, directory: Path) -> dict[str, str]:
    """The page's file blocks (```LANG file=NAME```), written into `directory`, and a GGUF file
    where the page names one; returns the environment its examples run in."""
    for name, text in re.findall(r"```\w+ file=(\S+)\n(.*?)```", page.read_text(), flags=re.S):
        (directory / name).write_text(text)
    if "tiny.gguf" not in page.read_text():
        return dict(os.environ)
    write_tiny_gguf(directory / "tiny.gguf")
    return {**os.environ, "POSTTRAIN_CACHE": str(directory / "cache")}


def commands(page: Path) -> list[list[str]]:
    lines = [line for block in blocks(page, "bash") for line in block.splitlines()]
    return [
        shlex.split(line.split("#")[0])[1:]
        for line in lines
        if line.startswith("posttrain ") and not line.startswith("posttrain serve")
    ]


def test_every_page_has_runnable_examples():
    assert {p.name for p in PAGES} >= {"architecture.md", "backends.md", "benchmarks.md"}
    assert all(blocks(p, "python") or commands(p) for p in PAGES if p.name != "benchmarks.md")


def test_every_python_block_is_run():
    """A python block runs here (no info string), is a file the page's examples use (`file=`),
    or is backends.md's `cluster` example, which tests/backends/test_ray_cluster.py runs on a
    two-node Ray cluster."""
    for page in PAGES:
        for info in re.findall(r"```python([^\n]*)\n", page.read_text()):
            cluster = info == " cluster" and page.name == "backends.md"
            assert info == "" or info.startswith(" file=") or cluster, (page.name, info)


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p, "python")], ids=lambda p: p.name)
def test_python_examples_run(page: Path, tmp_path: Path):
    tiny = tmp_path / "tiny"
    env = write_files(page, tmp_path)
    script = "\n".join(blocks(page, "python")).replace("/tmp/tiny", str(tiny))
    server = None
    if SERVER_URL in script:
        make_tiny_model(tiny)  # the page builds the same model (seed 0); the server needs it first
        server = start_server(tiny, tmp_path / "storage", keys=(SERVER_KEY,))
        script = script.replace(SERVER_URL, server.url)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", script],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
    finally:
        if server is not None:
            server.stop()
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if commands(p)], ids=lambda p: p.name)
def test_commands_run(page: Path, tmp_path: Path):
    env = write_files(page, tmp_path)
    for args in commands(page):
        args = [str(ROOT / a) if a.startswith("src/") else a for a in args]
        proc = subprocess.run(
            [sys.executable, "-m", "posttrain.cli.main", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-2000:])
