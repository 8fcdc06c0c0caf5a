"""The in-process OpenAI-compatible endpoint of LocalBackend and RayBackend: their registered
models, served on loopback.

`openai_endpoint` of either backend starts one `LocalOpenAIServer` the first time it is asked
and its `close` stops it. A RayBackend's requests sample on its workers through the model's
RayTrainingClient, whose calls run in order on that client's thread, as below. uvicorn runs in a daemon thread with its own event loop on
127.0.0.1, on a port the OS picks, behind a random per-server API key.

Threads. The server's thread never computes with torch. A LocalTrainingClient executes every
call (forward_backward, optim_step, sample, ...) one at a time, in submission order, on its
compute thread (`posttrain.engine.threads`), and submitting is thread-safe. The server's
sampling requests are submitted to that same queue, so torch never runs two calls on a model at
once, and never on a second thread: a request sampled while `train()` runs sees the weights of
the last completed `optim_step`, and never disturbs accumulated gradients (sampling runs in
inference mode). The tokenizer is the one object the server's thread would share with the
compute thread (which decodes stop strings), so the server uses its own copy.
"""

from __future__ import annotations

import copy
import hmac
import importlib.util
import json
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from posttrain.backends.model import OpenAIEndpoint, TrainableModel
from posttrain.data.checks import expect
from posttrain.inference.model_sampler import ModelSampler
from posttrain.server.sources import UnknownModelError
from posttrain.tokenizer import Tokenizer

if TYPE_CHECKING:
    from fastapi import FastAPI

    from posttrain.clients.local import LocalTrainingClient

INSTALL_HINT = "pip install 'posttrain[server]' openai"
STARTUP_TIMEOUT_S = 30.0


class ServingBackend(Protocol):
    """What the endpoint reads of a backend (LocalBackend, RayBackend)."""

    def registered_models(self) -> list[TrainableModel]: ...

    def client(self, model: TrainableModel) -> LocalTrainingClient: ...


class LocalModelSource:
    """A `SamplerSource` over a backend's registered models, each named by `model.name`.

    A name two registered models share (in different projects) is not served: it is ambiguous.
    There are no owners on loopback: `owner` is ignored. Looking a sampler up never blocks
    (the models are loaded, a tokenizer copy takes milliseconds once), so the router asks on
    its event loop rather than through a worker thread (`never_blocks`).
    """

    never_blocks = True

    def __init__(self, backend: ServingBackend) -> None:
        self.backend = backend
        self._tokenizers: weakref.WeakKeyDictionary[LocalTrainingClient, Tokenizer] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def models_by_name(self) -> dict[str, list[TrainableModel]]:
        out: dict[str, list[TrainableModel]] = {}
        for model in self.backend.registered_models():
            out.setdefault(model.name, []).append(model)
        return out

    def model_names(self, owner: str | None) -> list[str]:
        return sorted(name for name, models in self.models_by_name().items() if len(models) == 1)

    def sampler(self, name: str, owner: str | None) -> ModelSampler:
        models = self.models_by_name().get(name, [])
        if len(models) != 1:
            raise UnknownModelError(name)
        client = self.backend.client(models[0])
        return ModelSampler(client, self._tokenizer_copy(client))

    def _tokenizer_copy(self, client: LocalTrainingClient) -> Tokenizer:
        with self._lock:
            if client not in self._tokenizers:
                self._tokenizers[client] = copy.deepcopy(client.get_tokenizer())
            return self._tokenizers[client]


class LoopbackServer:
    """An ASGI app served by uvicorn in a daemon thread on 127.0.0.1, on a port the OS picks."""

    def __init__(self, app: FastAPI, *, name: str = "posttrain-openai") -> None:
        _check_installed()
        import uvicorn

        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        self.port: int = self._socket.getsockname()[1]
        config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._socket]},
            name=f"{name}-{self.port}",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server on 127.0.0.1:{self.port} did not start")
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Finish in-flight requests, stop serving, join the thread."""
        self._server.should_exit = True
        self._thread.join(timeout=STARTUP_TIMEOUT_S)
        self._socket.close()


class LocalOpenAIServer:
    """The OpenAI-compatible router for one backend, behind a random API key."""

    def __init__(self, backend: ServingBackend) -> None:
        self.source = LocalModelSource(backend)
        self.api_key = "sk-local-" + secrets.token_urlsafe(24)
        self.server = LoopbackServer(create_local_app(self.source, self.api_key))

    @property
    def base_url(self) -> str:
        return self.server.url + "/v1"

    def endpoint(self, model: TrainableModel) -> OpenAIEndpoint:
        models = self.source.models_by_name().get(model.name, [])
        if len(models) > 1:
            projects = sorted(m.project for m in models)
            raise ValueError(
                f"model name {model.name!r} is registered in several projects ({projects}); the "
                "OpenAI endpoint names models by name alone: give them distinct names"
            )
        return OpenAIEndpoint(self.base_url, self.api_key, model.name)

    def stop(self) -> None:
        self.server.stop()


def create_local_app(source: LocalModelSource, api_key: str) -> FastAPI:
    """The OpenAI router behind a check of `Authorization: Bearer <api_key>`."""
    _check_installed()
    from fastapi import FastAPI

    from posttrain.server.openai_api import create_openai_router

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(create_openai_router(source))
    app.add_middleware(BearerKey, expected=f"Bearer {api_key}".encode("latin-1"))
    return app


# ASGI's send: each message a dict of its event's fields.
Send = Callable[[dict[str, object]], Awaitable[None]]


class BearerKey:
    """A plain ASGI middleware that answers 401 unless `Authorization` is the expected value.

    Plain ASGI rather than `@app.middleware("http")`: Starlette's BaseHTTPMiddleware runs each
    request through a task group and a streamed response, which cost more per request than
    the rest of the routing (rollout loops send many small requests at once).
    """

    def __init__(self, app: Callable[..., Awaitable[None]], expected: bytes) -> None:
        self.app, self.expected = app, expected

    async def __call__(self, scope: dict[str, object], receive: object, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(expect(scope["headers"], list, "the ASGI scope's headers"))
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await _unauthorized(send)
                return
        await self.app(scope, receive, send)


async def _unauthorized(send: Send) -> None:
    from posttrain.server.openai_schema import OpenAIError

    error = OpenAIError(401, "missing or wrong API key", code="invalid_api_key")
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _check_installed() -> None:
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"serving the OpenAI-compatible endpoint needs {' and '.join(missing)}: {INSTALL_HINT}"
        )
