"""Print the package's shape: folders, top-level modules, import circles, class sizes,
type escapes and deep imports in the docs.

    python scripts/layout_report.py            # a readable report
    python scripts/layout_report.py --json     # the same figures, for comparing two commits

Import circles are strongly connected groups of files in the import graph (every import in a
file counts, lazy ones too: a lazy import hides a circle, it does not remove it). A circle
"between folders" is one whose files live in more than one folder; tests/test_guards.py
requires that there are none.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "posttrain"
SUPPRESSION = re.compile(r"#\s*(type|pyright):\s*ignore")
DEEP_IMPORT = re.compile(r"^\s*(?:from|import)\s+(posttrain\.[\w.]+)", re.MULTILINE)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def package_files() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(path: Path, modules: dict[str, Path]) -> set[str]:
    """The posttrain modules a file imports, a submodule named by `from pkg import sub` too."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name in modules}


def import_graph() -> dict[str, set[str]]:
    modules = package_files()
    return {name: imported_modules(path, modules) - {name} for name, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; groups of more than one module only."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(sorted(group))
            elif target not in index:
                index[target] = low[target] = len(index)
                stack.append(target)
                on_stack.add(target)
                work.append((target, iter(sorted(graph[target]))))
            elif target in on_stack:
                low[node] = min(low[node], index[target])
    return sorted(groups)


def folder_of(module: str) -> str:
    """posttrain.engine.ray.fsdp -> posttrain.engine.ray; a package's __init__ is its folder."""
    path = package_files()[module]
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def circles_between_folders() -> list[list[str]]:
    return [
        group
        for group in strongly_connected(import_graph())
        if len({folder_of(module) for module in group}) > 1
    ]


def class_sizes() -> list[tuple[int, str]]:
    sizes = []
    for name, path in package_files().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                sizes.append((node.end_lineno - node.lineno + 1, f"{name}.{node.name}"))
    return sorted(sizes, reverse=True)


def escapes() -> dict[str, int]:
    text = "\n".join(path.read_text() for path in package_files().values())
    return {
        "type: ignore": len(re.findall(r"#\s*type:\s*ignore", text)),
        "pyright: ignore": len(re.findall(r"#\s*pyright:\s*ignore", text)),
        "cast(": len(re.findall(r"\bcast\(", text)),
    }


def deep_imports_in_docs() -> list[str]:
    sources = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    sources += sorted((ROOT / "recipes").rglob("*.py"))
    found = []
    for path in sources:
        for match in DEEP_IMPORT.finditer(path.read_text()):
            found.append(f"{path.relative_to(ROOT)}: {match.group(1)}")
    return found


SAMPLE_NAMES = {"sample", "sample_many", "sample_batched"}
ENGINE_NAMES = {"pytorch", "vllm", "openai"}


def _strings(node: ast.AST) -> set[str]:
    return {
        leaf.value
        for leaf in ast.walk(node)
        if isinstance(leaf, ast.Constant) and isinstance(leaf.value, str)
    }


def sampling() -> dict[str, Any]:
    """Where sampling is defined: `sample*` methods, protocols that sample, and branches on
    an inference engine's name (`engine == "vllm"`, `in ("vllm", ...)`, `case "openai"`)."""
    definitions, protocols, branches = [], [], []
    for name, path in package_files().items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.name in SAMPLE_NAMES:
                    definitions.append(f"{name}:{node.lineno}")
            elif isinstance(node, ast.ClassDef):
                bases = {ast.unparse(base) for base in node.bases}
                methods = {
                    item.name
                    for item in node.body
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                }
                if bases & {"Protocol", "typing.Protocol"} and methods & SAMPLE_NAMES:
                    protocols.append(f"{name}.{node.name}")
            elif isinstance(node, ast.Compare):
                if _strings(node) & ENGINE_NAMES:
                    branches.append(f"{name}:{node.lineno}")
            elif isinstance(node, ast.match_case) and _strings(node.pattern) & ENGINE_NAMES:
                branches.append(f"{name}:{node.pattern.lineno}")
    return {
        "sample_definitions": len(definitions),
        "sample_definition_files": len({d.split(":")[0] for d in definitions}),
        "sampling_protocols": protocols,
        "engine_name_branches": len(branches),
        "engine_name_branch_files": sorted({b.split(":")[0] for b in branches}),
    }


def folder_lines(folder: str) -> tuple[int, int]:
    """(files, lines) of one folder, its subfolders included: "engine" -> engine/ and engine/ray/."""
    paths = [
        p
        for m, p in package_files().items()
        if m == f"posttrain.{folder}" or m.startswith(f"posttrain.{folder}.")
    ]
    return len(paths), sum(len(p.read_text().splitlines()) for p in paths)


def imports_between(source: str, target: str) -> list[str]:
    """Each (file of `source`/, module of `target`/) import: "server", "engine"."""
    prefix, into = f"posttrain.{source}.", f"posttrain.{target}"
    return sorted(
        f"{module} -> {imported}"
        for module, imported_set in import_graph().items()
        if module.startswith(prefix)
        for imported in imported_set
        if imported == into or imported.startswith(into + ".")
    )


def report() -> dict[str, Any]:
    folders = {
        str(path.relative_to(PACKAGE)): len(list(path.glob("*.py")))
        for path in sorted(PACKAGE.rglob("*"))
        if path.is_dir() and (path / "__init__.py").exists()
    }
    top_level = sorted(
        path.stem for path in PACKAGE.glob("*.py") if path.stem not in ("__init__", "__main__")
    )
    sizes = class_sizes()
    return {
        "modules": len(package_files()),
        "lines": sum(len(p.read_text().splitlines()) for p in package_files().values()),
        "folders": folders,
        "top_level_modules": top_level,
        "circles_between_folders": circles_between_folders(),
        "circles": strongly_connected(import_graph()),
        "engine_files_lines": folder_lines("engine"),
        "server_imports_of_engine": imports_between("server", "engine"),
        "sampling": sampling(),
        "largest_classes": [f"{n} {name}" for n, name in sizes[:5]],
        "escapes": escapes(),
        "deep_imports_in_docs": deep_imports_in_docs(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    figures = report()
    if parser.parse_args().json:
        json.dump(figures, sys.stdout, indent=2)
        print()
        return
    folders, top, circles = (
        figures["folders"],
        figures["top_level_modules"],
        figures["circles_between_folders"],
    )
    print(f"{figures['modules']} modules, {figures['lines']} lines")
    print(f"folders ({len(folders)}): " + ", ".join(f"{k}/ {v}" for k, v in folders.items()))
    print(f"top-level modules ({len(top)}): {', '.join(top)}")
    print(f"import circles between folders: {len(circles)}")
    for group in circles:
        print(f"  {len(group)} files: {', '.join(group)}")
    print(f"import circles, any: {len(figures['circles'])}")
    for group in figures["circles"]:
        print(f"  {', '.join(group)}")
    files, lines = figures["engine_files_lines"]
    print(f"engine/: {files} files, {lines} lines")
    server_engine = figures["server_imports_of_engine"]
    print(f"imports of engine/ from server/: {len(server_engine)}")
    for line in server_engine:
        print(f"  {line}")
    sampling_figures = figures["sampling"]
    print(
        f"sample* definitions: {sampling_figures['sample_definitions']} in "
        f"{sampling_figures['sample_definition_files']} files; protocols that sample: "
        + ", ".join(sampling_figures["sampling_protocols"])
    )
    print(
        f"branches on an engine's name: {sampling_figures['engine_name_branches']} in "
        + ", ".join(sampling_figures["engine_name_branch_files"])
    )
    print("largest classes (lines): " + "; ".join(figures["largest_classes"]))
    print("type escapes: " + ", ".join(f"{k} {v}" for k, v in figures["escapes"].items()))
    print(f"deep imports in README, docs/ and recipes/: {len(figures['deep_imports_in_docs'])}")
    for line in figures["deep_imports_in_docs"]:
        print(f"  {line}")


if __name__ == "__main__":
    main()
