"""Guards on the repository itself: small modules, and no path of the machine that wrote it."""

from __future__ import annotations

import ast
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


# shared/DESIGN.md's layers, bottom up: a module imports only from its own layer or below.
# Rollouts (tasks, environments, evaluation, ...) sit beside the trainer, never inside it.
LAYERS: list[set[str]] = [
    {"types", "data", "logging_sinks", "tokenizer", "dotted_paths", "run_records"},
    {"algo"},
    {"engine"},
    {"clients"},
    {"inference", "trainer", "rollouts", "tasks", "environments", "blocks"},
    {"backends"},
    {"server"},
    {"jobs"},
    {"cli", "__main__", "__init__"},
]
LAYER_OF = {unit: level for level, units in enumerate(LAYERS) for unit in units}


def _unit(module: str) -> str:
    """posttrain.engine.worker -> engine; posttrain.types -> types; posttrain -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m == "posttrain" or m.startswith("posttrain.")}


def test_imports_point_down_the_layers():
    package = ROOT / "src" / "posttrain"
    upward, unplaced = [], set()
    for path in package.rglob("*.py"):
        rel = path.relative_to(package)
        first = rel.parts[0]
        unit = first.removesuffix(".py") if first != "__init__.py" else "__init__"
        if unit not in LAYER_OF:
            unplaced.add(unit)
            continue
        for module in _imports(path):
            target = _unit(module)
            if target not in LAYER_OF:
                unplaced.add(target)
            elif LAYER_OF[target] > LAYER_OF[unit] or (unit == "algo" and target != "algo"):
                upward.append(f"{rel} imports {module}")
    assert not unplaced, f"give these a layer in LAYERS (see shared/DESIGN.md): {sorted(unplaced)}"
    assert not upward, "imports that point up the layers (algo imports only algo):\n" + "\n".join(
        sorted(upward)
    )


# Only pyright runs, and pyproject turns mypy-style ignore comments off (pyright would read each
# as silencing every rule on its line); a pyright ignore without a rule silences them all too.
SUPPRESSION = re.compile(r"#\s*(type|pyright):\s*ignore(\[[^\]]*\])?")
MAX_ESCAPES_IN_SRC = 60  # suppressions plus casts in src/posttrain (issue 25)


def _python_files(*folders: str) -> list[Path]:
    return [p for p in tracked_files() if p.suffix == ".py" and p.parts[len(ROOT.parts)] in folders]


def test_each_suppression_names_its_pyright_rule():
    bad = [
        f"{path.relative_to(ROOT)}:{number}: {match.group(0)}"
        for path in _python_files("src", "tests", "benchmarks", "recipes", "scripts")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for match in SUPPRESSION.finditer(line)
        if match.group(1) == "type" or not match.group(2)
    ]
    assert not bad, "write these as `# pyright: ignore[rule]`:\n" + "\n".join(bad)


def test_src_keeps_its_type_escapes_few():
    text = "\n".join(path.read_text() for path in _python_files("src"))
    escapes = len(SUPPRESSION.findall(text)) + len(re.findall(r"\bcast\(", text))
    assert escapes <= MAX_ESCAPES_IN_SRC, (
        f"{escapes} suppressions and casts in src (at most {MAX_ESCAPES_IN_SRC}): fix a type "
        "instead (a TypeGuard, a Protocol, posttrain.data.checks for values from outside)"
    )
