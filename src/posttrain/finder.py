"""Importing user code named by dotted path ("pkg.module:attribute"), with errors that say
which module failed and why."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

DOTTED_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class ImportTargetError(ValueError):
    """A dotted path that is malformed, does not import, or lacks its attribute."""


def import_object(spec: str, what: str, *, search: Path | None = None) -> object:
    """The object `spec` ("pkg.module:attr.sub") names; `what` ("task", "reward") is for errors.

    `search` is a directory to import from after `sys.path` (a config file's directory, so a
    module beside it imports as it would from there with `python -m`).
    """
    if not DOTTED_PATH.match(spec):
        raise ImportTargetError(
            f"{what} {spec!r} is not a dotted path; write it as 'package.module:name'"
        )
    module_name, _, attr = spec.partition(":")
    if search is not None and str(search) not in sys.path:
        sys.path.append(str(search))  # last: an installed package of the same name wins
    try:
        obj: object = importlib.import_module(module_name)
    except Exception as exc:  # user code may fail in any way on import; report it
        where = f" (looked in sys.path and {search})" if search is not None else ""
        raise ImportTargetError(
            f"{what} {spec!r}: module {module_name!r} does not import: "
            f"{type(exc).__name__}: {exc}{where}"
        ) from exc
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            owner = ".".join([module_name, *attr.split(".")[:i]])
            raise ImportTargetError(
                f"{what} {spec!r}: {owner!r} has no attribute {part!r}{_nearest(part, dir(obj))}"
            )
        obj = getattr(obj, part)
    return obj


def target_of(obj: object) -> str:
    """`module:qualname` of a class or function (of an instance: of its class)."""
    named = obj if hasattr(obj, "__qualname__") else type(obj)
    return f"{getattr(named, '__module__', '?')}:{getattr(named, '__qualname__', '?')}"


def _nearest(name: str, names: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, [n for n in names if not n.startswith("_")], n=1)
    return f"; did you mean {close[0]!r}?" if close else ""
