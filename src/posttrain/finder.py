"""Finding what a string names: a built-in, a dotted path ("package.module:name", the name
may be dotted too: "package.module:Class.attribute"), or an entry point of an installed
distribution. One error style and one suggestion helper for all of them.

Each kind of thing (backends, tasks, environments, losses, rewards, uncertainty kinds) keeps
its own table of built-ins and describes itself with a `Kind`. `find` says where a name points
without importing anything; `load` gives the object. A name is looked up in this order: the
built-ins, then a dotted path (any name with a ':'), then the kind's entry-point group; an
unknown name suggests the nearest known one.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DOTTED_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
Source = Literal["builtin", "path", "entry_point"]


class NotFound(ValueError):
    """A name that finds nothing, or a malformed dotted path; the message says what to fix."""


class ImportFailed(NotFound, ImportError):
    """A dotted path whose module does not import or lacks the attribute: an ImportError too,
    as any failed import is."""


@dataclass(frozen=True)
class Kind:
    """One kind of thing named by a string, and how errors speak of it."""

    what: str  # "task", "backend": how errors name one
    builtins: Mapping[str, object]  # name -> the built-in (the caller's own table)
    group: str | None = None  # the entry-point group of installed ones
    example: str = "mypkg.module:name"  # a dotted path of one of your own
    form: str = "package.module:name"  # how a dotted path is written
    plural: str = ""  # default: `what` + "s"
    also: str = ""  # another way to add one ("register it with register_loss")

    def known(self) -> list[str]:
        """The built-ins, then the installed entry points in name order."""
        installed = entry_points(self.group) if self.group else {}
        return [*self.builtins, *sorted(set(installed) - set(self.builtins))]


@dataclass(frozen=True)
class Found:
    """Where a name points."""

    spec: str  # as given
    source: Source
    target: str  # the dotted path to import ("package.module:name"); a built-in: its name
    what: str  # how errors name it: "task", or "task 'x' (entry point in posttrain.tasks)"
    builtin: object = None  # the built-in itself, from the kind's table

    def load(self, *, search: Path | None = None) -> object:
        """The built-in, or what the dotted path or entry point imports (`search`: a directory
        to import from after `sys.path`)."""
        if self.source == "builtin":
            return self.builtin
        return import_object(self.target, self.what, search=search)


def find(spec: str, kind: Kind) -> Found:
    """Where `spec` points, without importing anything; NotFound for a malformed dotted path
    or an unknown name (listing the known ones and suggesting the nearest)."""
    if spec in kind.builtins:
        return Found(spec, "builtin", spec, kind.what, kind.builtins[spec])
    if ":" in spec:
        check_dotted_path(spec, kind.what, kind.form)
        return Found(spec, "path", spec, kind.what)
    installed = entry_points(kind.group) if kind.group else {}
    if spec in installed:
        where = f"{kind.what} {spec!r} (entry point in {kind.group})"
        return Found(spec, "entry_point", installed[spec], where)
    raise NotFound(unknown(spec, kind))


def load(spec: str, kind: Kind, *, search: Path | None = None) -> object:
    """The object `spec` names: the built-in of that name, else what its dotted path or entry
    point imports (`search`: a directory to import from after `sys.path`)."""
    return find(spec, kind).load(search=search)


def unknown(spec: str, kind: Kind) -> str:
    """The message for a name that is none of `kind`'s: the known ones, the nearest, and how
    to add one of your own."""
    known = kind.known()
    ways = [f"name one of your own by its dotted path, e.g. {kind.example!r}"]
    ways += [kind.also] if kind.also else []
    ways += [f"install it under the {kind.group!r} entry-point group"] if kind.group else []
    how = ", ".join(ways[:-1]) + f", or {ways[-1]}" if len(ways) > 1 else ways[0]
    return (
        f"unknown {kind.what} {spec!r}{did_you_mean(spec, known)} "
        f"(known {kind.plural or kind.what + 's'}: {', '.join(known) or 'none'}; {how})"
    )


def check_dotted_path(spec: str, what: str, form: str = "package.module:name") -> None:
    """NotFound unless `spec` is written as `form` ("package.module:name")."""
    if not DOTTED_PATH.match(spec):
        raise NotFound(f"{what} {spec!r} is not a dotted path; write it as {form!r}")


def import_object(spec: str, what: str, *, search: Path | None = None) -> object:
    """The object `spec` ("pkg.module:attr.sub") names; `what` ("task", "reward") is for errors.

    `search` is a directory to import from after `sys.path` (a config file's directory, so a
    module beside it imports as it would from there with `python -m`).
    """
    check_dotted_path(spec, what)
    module_name, _, attr = spec.partition(":")
    if search is not None and str(search) not in sys.path:
        sys.path.append(str(search))  # last: an installed package of the same name wins
    try:
        obj: object = importlib.import_module(module_name)
    except Exception as exc:  # user code may fail in any way on import; report it
        where = f" (looked in sys.path and {search})" if search is not None else ""
        raise ImportFailed(
            f"{what} {spec!r}: module {module_name!r} does not import: "
            f"{type(exc).__name__}: {exc}{where}"
        ) from exc
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            owner = ".".join([module_name, *attr.split(".")[:i]])
            public = [n for n in dir(obj) if not n.startswith("_")]
            raise ImportFailed(
                f"{what} {spec!r}: {owner!r} has no attribute {part!r}{did_you_mean(part, public)}"
            )
        obj = getattr(obj, part)
    return obj


def entry_points(group: str) -> dict[str, str]:
    """Installed entries of an entry-point group: name -> dotted path."""
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=group)}


def target_of(obj: object) -> str:
    """`module:qualname` of a class or function (of an instance: of its class)."""
    named = obj if hasattr(obj, "__qualname__") else type(obj)
    return f"{getattr(named, '__module__', '?')}:{getattr(named, '__qualname__', '?')}"


def nearest(name: str, names: Iterable[str]) -> str | None:
    """The known name closest to a misspelt one, if any is close (difflib's ratio >= 0.6)."""
    close = difflib.get_close_matches(name, list(names), n=1)
    return close[0] if close else None


def did_you_mean(name: str, names: Iterable[str]) -> str:
    """The suffix "; did you mean 'x'?" for the nearest of `names`, or "" when none is close."""
    close = nearest(name, names)
    return f"; did you mean {close!r}?" if close else ""
