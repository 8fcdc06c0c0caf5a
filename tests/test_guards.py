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
    {"types", "data", "logging_sinks", "tokenizer", "finder", "run_records"},
    {"algo", "models"},
    {"engine"},
    {"clients"},
    {"inference", "trainer", "rollouts", "tasks", "environments", "blocks"},
    {"backends"},
    {"server"},
    {"jobs"},
    {"cli", "__main__", "__init__"},
]
LAYER_OF = {unit: level for level, units in enumerate(LAYERS) for unit in units}
# algo is pure math: it imports only itself, and the finder for its "did you mean" (the finder
# imports nothing of posttrain and only the standard library).
ALGO_MAY = {"algo", "finder"}


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


def test_the_finder_imports_nothing_of_posttrain():
    # So that algo may use its suggestion helper and stay free of everything else.
    assert _imports(ROOT / "src" / "posttrain" / "finder.py") == set()


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
            elif LAYER_OF[target] > LAYER_OF[unit] or (unit == "algo" and target not in ALGO_MAY):
                upward.append(f"{rel} imports {module}")
    assert not unplaced, f"give these a layer in LAYERS (see shared/DESIGN.md): {sorted(unplaced)}"
    assert not upward, (
        "imports that point up the layers (algo imports only algo and the finder):\n"
        + "\n".join(sorted(upward))
    )


def _layout_report():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "layout_report", ROOT / "scripts" / "layout_report.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_import_circle_between_folders():
    # Lazy imports count: one hides a circle, it does not remove it. Within a folder a circle
    # is the folder's own business (a package and its modules).
    circles = _layout_report().circles_between_folders()
    assert not circles, "import circles between folders (scripts/layout_report.py):\n" + "\n".join(
        ", ".join(group) for group in circles
    )


def test_at_most_seven_top_level_modules():
    # New work finds its room (CONTRIBUTING.md), it does not land beside the package's rooms.
    top = _layout_report().report()["top_level_modules"]
    assert len(top) <= 7, f"top-level modules: {top}"


# Users' code imports from `posttrain`; three namespaces are public by design: the building
# blocks of seed 004 (`posttrain.blocks`), and the task and environment packages users name in
# their TOML (`posttrain.tasks`, `posttrain.environments`). The README, docs and recipes show
# users' code, so they import nothing deeper.
PUBLIC_NAMESPACES = {"posttrain.blocks", "posttrain.tasks", "posttrain.environments"}


def test_docs_and_recipes_import_from_the_top_level():
    found = _layout_report().deep_imports_in_docs()  # "path: module" lines
    deep = [line for line in found if line.rpartition(": ")[2] not in PUBLIC_NAMESPACES]
    assert not deep, "import these from `posttrain` (add to posttrain._EXPORTS if needed):\n" + (
        "\n".join(sorted(deep))
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


def test_weights_are_written_through_file_modes():
    # safetensors' save_file leaves its file 0600 (models/file_modes.py says why): every writer
    # of weights calls file_modes.save_tensors, which gives it the umask's mode.
    writers = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "src" / "posttrain").rglob("*.py")
        if path.name != "file_modes.py" and re.search(r"\bsave_file\b", path.read_text())
    ]
    assert not writers, f"write weights with file_modes.save_tensors in: {writers}"
