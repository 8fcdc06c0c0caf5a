"""How a backend serves its models OpenAI-style without importing the server layer above it.

`server/` sits above `backends/`, so a backend never imports it. The server layer instead
registers its implementation under the `posttrain.openai_servers` entry-point group
(posttrain's own, `posttrain.server.local_openai:LocalOpenAIServer`, is declared in
pyproject.toml). A backend asks for one with `start_openai_server(self)`; what it gets back is
the small `OpenAIServer` protocol below. The server receives the backend and reads its
registered models through the backend's public methods: the dependency points down.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

from posttrain.finder import entry_points, import_object

if TYPE_CHECKING:
    from posttrain.backends.model import OpenAIEndpoint, TrainableModel

ENTRY_POINT_GROUP = "posttrain.openai_servers"
INSTALL_HINT = "pip install 'posttrain[server]' openai"


class OpenAIServer(Protocol):
    """A running OpenAI-compatible server over one backend's registered models."""

    def endpoint(self, model: TrainableModel) -> OpenAIEndpoint:
        """Base URL, API key and model name under which `model`'s latest weights are served."""
        ...

    def stop(self) -> None:
        """Finish in-flight requests and stop serving."""
        ...


OpenAIServerFactory = Callable[[object], OpenAIServer]


def start_openai_server(backend: object, name: str = "local") -> OpenAIServer:
    """Start the server registered as `name` for `backend` (its factory is called with it)."""
    installed = entry_points(ENTRY_POINT_GROUP)
    if name not in installed:
        raise ImportError(
            f"no OpenAI-compatible server {name!r} is registered under the {ENTRY_POINT_GROUP!r} "
            f"entry points; install posttrain with the server extra ({INSTALL_HINT})"
        )
    what = f"OpenAI-compatible server {name!r} (entry point in {ENTRY_POINT_GROUP})"
    factory = cast(OpenAIServerFactory, import_object(installed[name], what))
    return factory(backend)
