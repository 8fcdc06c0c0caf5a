"""Every example in docs/ runs: the python blocks of each page in order in one process (on a
tiny model, in a temporary directory, against a real `posttrain serve` where a page uses one),
and the `posttrain` commands of its bash blocks (all but `serve`, which a page's python uses),
at one torch thread, so that a seeded run prints the same on every run. A page that names a
`.gguf` file gets a cache of its own ($POSTTRAIN_CACHE); it makes the file itself.

A block whose info string names a file (```toml file=job.toml```) is that file's content: it
is written into the directory before the page's python blocks run, and before its commands.
A block whose info string is `output` is what the block before it prints, and is checked
against it (tests/shown_output.py has the rules)."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from posttrain.models.tiny import make_tiny_model
from script_runner import ScriptRunner
from shown_output import mismatch

ROOT = Path(__file__).parents[1]
BENCHMARKS = ROOT / "benchmarks"
PAGES = sorted((ROOT / "docs").glob("*.md"))
SERVER_URL = "http://127.0.0.1:8000"  # where a page's python expects `posttrain serve`
SERVER_KEY = "tml-mykey"

# The server tests' helper starts `posttrain serve` on a free port (tests/ is not a package).
sys.path.insert(0, str(ROOT / "tests" / "server"))
from serve_helpers import start_server  # noqa: E402  # pyright: ignore[reportMissingImports]

# Printed before each python block, so that each block's stdout can be told apart.
BLOCK_MARK = "=== docs block {} ==="
BLOCK_SPLIT = re.compile(r"^=== docs block \d+ ===\n", flags=re.M)


def blocks(page: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", page.read_text(), flags=re.S)


@dataclass(frozen=True)
class Shown:
    """An output block: what the `index`-th block of `language` on its page prints."""

    language: str
    index: int
    text: str


def shown_outputs(page: Path) -> list[Shown]:
    """The page's output blocks, each with the python or bash block right before it."""
    text = page.read_text()
    fences = list(re.finditer(r"```([^\n]*)\n(.*?)```", text, flags=re.S))
    counts = {"python": 0, "bash": 0}
    shown: list[Shown] = []
    for before, fence in zip([None, *fences], fences, strict=False):
        info = fence.group(1)
        if info == "output":
            assert before is not None and before.group(1) in counts, (page.name, fence.start())
            between = text[before.end() : fence.start()]
            assert not between.strip(), f"{page.name}: text between a block and its output"
            shown.append(Shown(before.group(1), counts[before.group(1)] - 1, fence.group(2)))
        elif info in counts:
            counts[info] += 1
    return shown


def write_files(page: Path, directory: Path) -> dict[str, str]:
    """The page's file blocks (```LANG file=NAME```), written into `directory`; returns the
    environment its examples run in: one torch thread, unbuffered output (a block's prints and
    those of the processes it starts keep their order), and for a page with a GGUF file a cache
    of its own in `directory`."""
    for name, text in re.findall(r"```\w+ file=(\S+)\n(.*?)```", page.read_text(), flags=re.S):
        (directory / name).write_text(text)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if ".gguf" in page.read_text():
        env["POSTTRAIN_CACHE"] = str(directory / "cache")
    return env


def block_commands(block: str) -> list[list[str]]:
    return [
        shlex.split(line.split("#")[0])[1:]
        for line in block.splitlines()
        if line.startswith("posttrain ") and not line.startswith("posttrain serve")
    ]


def commands(page: Path) -> list[list[str]]:
    return [args for block in blocks(page, "bash") for args in block_commands(block)]


def check_shown(page: Path, language: str, printed: list[str]) -> None:
    """Each output block of `language` on the page is what its block printed."""
    for shown in shown_outputs(page):
        if shown.language == language:
            diff = mismatch(shown.text, printed[shown.index])
            assert diff is None, f"{page.name}, {language} block {shown.index + 1}:\n{diff}"


def test_every_page_has_runnable_examples():
    assert {p.name for p in PAGES} >= {"architecture.md", "backends.md", "benchmarks.md"}
    assert all(blocks(p, "python") or commands(p) for p in PAGES if p.name != "benchmarks.md")


def test_every_output_block_follows_the_block_it_shows():
    """Parsing checks it; the pages with shown output are found."""
    shown = {p.name: shown_outputs(p) for p in PAGES}
    assert shown["own-task.md"], "own-task.md shows the async job's output"


def test_every_python_block_is_run():
    """A python block runs here (no info string), is a file the page's examples use (`file=`),
    or is backends.md's `cluster` example, which tests/backends/test_ray_cluster.py runs on a
    two-node Ray cluster."""
    for page in PAGES:
        for info in re.findall(r"```python([^\n]*)\n", page.read_text()):
            cluster = info == " cluster" and page.name == "backends.md"
            assert info == "" or info.startswith(" file=") or cluster, (page.name, info)


def scaling_costs() -> Any:
    """benchmarks/scaling_costs.py as a module (benchmarks/ is not a package; its scripts import
    their helpers, such as host.py, from their own directory)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("scaling_costs", BENCHMARKS / "scaling_costs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_scaling_tables_are_what_the_benchmark_derives():
    """docs/scaling.md's tables are `scaling_costs.py --derive`'s output, verbatim."""
    text = (ROOT / "docs" / "scaling.md").read_text()
    tables = scaling_costs().derived_tables()
    assert len(tables) == 5
    for title, table in tables.items():
        assert table in text, f"docs/scaling.md lacks the table {title!r}: rerun --derive"


def test_scaling_derivation_adds_up_by_hand():
    """Two cells of the memory table and one of the time table, from the page's assumptions."""
    costs = scaling_costs()
    gib = 2**30
    # Qwen2.5-0.5B, full, 1 GPU, checkpointing: 16 B per weight; per token each of 24 layers'
    # fp32 input (4 x 896 B), one recomputed layer (107,584 B) and 12.7 x 896 B besides; 1.14
    # chunks of 1024 x 151,936 fp32 logits.
    want = 16 * 494_032_768 + 8192 * (24 * 4 * 896 + 107_584 + 12.7 * 896)
    want += 1.14 * 1024 * 151_936 * 4
    got = costs.memory_per_gpu(costs.SHAPES["qwen2.5-0.5b"], 1, False, True)
    assert got == pytest.approx(want / gib, rel=1e-12)
    # Llama-3.1-8B, full, FSDP2 x8, checkpointing: the unembedding (128,256 x 4,096) whole, the
    # rest cut 8 ways; the untied embedding, two layers of 218,112,000 weights and one layer's
    # gradients whole, 4 B each.
    unembedding, layer = 128_256 * 4096, 218_112_000
    want = 16 * ((8_030_261_248 - unembedding) / 8 + unembedding)
    want += 4 * (unembedding + 2 * layer + layer)
    want += 8192 * (32 * 4 * 4096 + 368_776 + 12.7 * 4096) + 1.14 * 1024 * 128_256 * 4
    got = costs.memory_per_gpu(costs.SHAPES["llama-3.1-8b"], 8, False, True)
    assert got == pytest.approx(want / gib, rel=1e-12)
    assert f"{got:.1f}" == "34.0"  # as the page's table says
    # Qwen2.5-7B, LoRA, 8 GPUs: 6 N per token, N = every weight but the untied input embedding.
    n = 7_615_616_512 - 152_064 * 3584
    want = 6 * n * 1e6 / (8 * 989e12 * 0.35)
    got = costs.seconds_per_million_tokens(costs.SHAPES["qwen2.5-7b"], 8, True)
    assert got == pytest.approx(want, rel=1e-12)


@pytest.fixture(scope="module")
def runner() -> Iterator[ScriptRunner]:
    """One interpreter for the module's pages and commands (tests/script_runner.py)."""
    shared = ScriptRunner(env={**os.environ, "OMP_NUM_THREADS": "1"})
    yield shared
    shared.close()


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p, "python")], ids=lambda p: p.name)
def test_python_examples_run(page: Path, runner: ScriptRunner, tmp_path: Path):
    """The page's python blocks in order, as one script (in the module's shared interpreter,
    tests/script_runner.py)."""
    tiny = tmp_path / "tiny"
    env = write_files(page, tmp_path)
    script = "".join(
        f"print({BLOCK_MARK.format(i)!r}, flush=True)\n{block}"
        for i, block in enumerate(blocks(page, "python"))
    ).replace("/tmp/tiny", str(tiny))
    server = None
    if SERVER_URL in script:
        make_tiny_model(tiny)  # the page builds the same model (seed 0); the server needs it first
        server = start_server(tiny, tmp_path / "storage", keys=(SERVER_KEY,))
        script = script.replace(SERVER_URL, server.url)
    (tmp_path / "page.py").write_text(script)  # run from its folder, as `python -c` from cwd
    try:
        # A page's own call of a deprecated API (the tinker SDK's and transformers' warn with a
        # FutureWarning, attributed to their caller) fails it: examples show current forms.
        options = ["-W", "error::FutureWarning:__main__"]
        proc = runner.run([*options, str(tmp_path / "page.py")], cwd=tmp_path, env=env, timeout=600)
    finally:
        if server is not None:
            server.stop()
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = BLOCK_SPLIT.split(proc.stdout)
    check_shown(page, "python", printed[1:])  # [0]: nothing runs before the first block


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if commands(p)], ids=lambda p: p.name)
def test_commands_run(page: Path, runner: ScriptRunner, tmp_path: Path):
    """Each command as `python -m posttrain.cli.main ARGS` would run it, in one interpreter for
    the module's commands (tests/script_runner.py: torch and transformers imported once)."""
    env = write_files(page, tmp_path)
    printed: list[str] = []
    for block in blocks(page, "bash"):
        printed.append("")
        for args in block_commands(block):
            args = [str(ROOT / a) if a.startswith("src/") else a for a in args]
            proc = runner.run(
                ["-m", "posttrain.cli.main", *args], cwd=tmp_path, env=env, timeout=300
            )
            assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-2000:])
            printed[-1] += proc.stdout
    check_shown(page, "bash", printed)


def test_every_ratio_to_trl_names_its_host():
    """A ratio to TRL moves with the CPU (1.96x on an AMD EPYC with AVX2, 1.58x on a Xeon with
    AVX-512 and AMX, the same code): each row of benchmarks.md's table that gives one says where
    it was measured."""
    rows = [
        line
        for line in (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
        if line.startswith("| GRPO step vs TRL")
    ]
    assert len(rows) >= 5
    unnamed = [row[:80] for row in rows if not re.search(r"AMD EPYC|Xeon", row)]
    assert not unnamed, f"name the host of these ratios: {unnamed}"
