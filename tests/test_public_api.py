"""The top-level API: one list of names (`posttrain._EXPORTS`), the type checkers' imports agree
with it, every name loads from the module it names, and `import posttrain` stays light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import posttrain

INIT = Path(posttrain.__file__)


def type_checking_imports() -> dict[str, str]:
    """name -> module of the `if TYPE_CHECKING:` imports of posttrain/__init__.py."""
    found: dict[str, str] = {}
    for node in ast.parse(INIT.read_text()).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module, ast.unparse(imp)
                for alias in imp.names:
                    # `X as X`: an explicit re-export, as type checkers read a package's API
                    assert alias.asname == alias.name, ast.unparse(imp)
                    assert alias.name not in found, f"{alias.name} is imported twice"
                    found[alias.name] = imp.module
    return found


def test_the_type_checkers_imports_are_the_exports():
    assert type_checking_imports() == posttrain._EXPORTS


def test_all_is_the_exports():
    assert posttrain.__all__ == ["__version__", *posttrain._EXPORTS]
    assert len(set(posttrain.__all__)) == len(posttrain.__all__)
    # STYLE.md: a short list, grouped by purpose; the rest is importable from its module. It
    # holds what the README, docs/ and recipes/ need (tests/test_docs.py keeps them to the
    # top level): 35, with ART's `Model`, which `import posttrain as art` code names; 36 with
    # `export_model`, the last step of "from data to a deployed model" (docs/export.md).
    assert 20 <= len(posttrain._EXPORTS) <= 36


@pytest.mark.parametrize("name", sorted(posttrain._EXPORTS))
def test_every_name_loads_from_the_module_that_defines_it(name: str):
    value = getattr(posttrain, name)
    assert value.__module__ == posttrain._EXPORTS[name]
    assert name in dir(posttrain)


def test_a_wrong_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'posttrain' has no attribute 'LocalBackends'"):
        posttrain.LocalBackends  # pyright: ignore[reportAttributeAccessIssue]  # noqa: B018


def test_star_import_gives_the_exports():
    names: dict[str, object] = {}
    exec("from posttrain import *", names)
    assert set(names) - {"__builtins__"} == set(posttrain.__all__)


def test_importing_posttrain_imports_nothing_heavy():
    # In a fresh interpreter: the names load on first use, so `import posttrain` alone imports
    # none of posttrain's modules, nor torch, transformers or numpy.
    code = (
        "import sys; import posttrain; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('posttrain', 'torch', 'transformers', 'numpy')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['posttrain']", out.stdout
