"""User-facing backends. `load("mypkg.module:Factory")` (or a built-in or entry-point name)
returns a backend class or factory; `describe(name)` its capabilities and option schemas.

Both are loaded on first use, so importing this package imports nothing heavy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from posttrain.backends.plugins.registry import describe, load

__all__ = ["describe", "load"]


def __getattr__(name: str) -> object:
    if name in __all__:
        from posttrain.backends.plugins import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'posttrain.backends' has no attribute {name!r}")
