"""`create_app`: the FastAPI application of `posttrain serve`.

Three ASGI layers wrap every route. The body limit answers 413 for a request larger than
`max_body_bytes` (by its Content-Length, or while it streams). Auth reads `X-API-Key` (or
`Authorization: Bearer`, which OpenAI clients send) and sets `request.state.owner` to a hash of
the key; every row the server stores carries that owner. With no keys configured (loopback
only) any `tml-` key is accepted and still isolated from the others. Every 4xx has a JSON body:
the SDK treats an empty 400 as a dropped connection.

The error boundary, outermost, answers an exception that escapes a route with a 500 (JSON, with
an error id) and keeps the connection open: Starlette's own handler re-raises after answering,
and uvicorn then drops the connection, which the SDK reports as a network failure. A body that
does not fit its schema gets a 422 whose `detail` names each wrong field.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from posttrain.server.config import EXTERNAL_FILES, KEY_PREFIX, ServerConfig, owner_of
from posttrain.server.runtime import Runtime
from posttrain.server.store import Store

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Message = dict[str, Any]


async def send_json(send: Any, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


class BodyLimit:
    """413 with a JSON body for requests over `limit` bytes."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        message = f"request body exceeds the server's limit of {self.limit} bytes (--max-body-mb)"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await send_json(send, 413, message)
            return
        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise _TooLarge
            return msg

        async def tracking_send(msg: Message) -> None:
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await send_json(send, 413, message)


class ErrorBoundary:
    """500 with a JSON body and an error id for an exception that escapes the app; the details
    stay in the log under that id (they may name files, paths or other callers' ids)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(msg: Message) -> None:
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:  # half a response is out: only closing the connection can end it
                raise
            error_id = uuid.uuid4().hex[:12]
            log.error(
                "internal error %s on %s %s",
                error_id,
                scope.get("method"),
                scope.get("path"),
                exc_info=(type(exc), exc, exc.__traceback__),
            )
            await send_json(send, 500, f"internal server error (error id {error_id})")


def _printable(text: str) -> str:
    """`text` with anything UTF-8 cannot encode (lone surrogates) escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def validation_detail(exc: RequestValidationError) -> str:
    """One line per problem, each naming the field (`body.adam_params.learning_rate`)."""
    problems = []
    for error in exc.errors()[:5]:
        field = ".".join(str(part) for part in error.get("loc", ())) or "request"
        message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        problems.append(_printable(f"{field}: {message}"))
    more = len(exc.errors()) - len(problems)
    return "invalid request: " + "; ".join(problems) + (f" (and {more} more)" if more else "")


class ApiKeyAuth:
    """Checks the key on every request and sets `scope["state"]["owner"]`."""

    def __init__(self, app: Any, keys: tuple[str, ...]) -> None:
        self.app, self.keys = app, keys

    def accepts(self, key: str) -> bool:
        if not key.startswith(KEY_PREFIX):
            return False
        if not self.keys:
            return True
        # Compare against every key so the time taken does not reveal which one matched.
        matches = [hmac.compare_digest(key.encode(), k.encode()) for k in self.keys]
        return any(matches)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"].startswith(EXTERNAL_FILES):
            # A download URL of external weights carries its own token (`tinker_external`).
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        key = headers.get(b"x-api-key", b"").decode("latin-1").strip()
        bearer = headers.get(b"authorization", b"").decode("latin-1")
        if not key and bearer.lower().startswith("bearer "):
            key = bearer[7:].strip()
        if not key:
            await send_json(send, 401, "missing API key: send X-API-Key (or Authorization: Bearer)")
            return
        if not self.accepts(key):
            await send_json(send, 401, "invalid API key")
            return
        scope.setdefault("state", {})["owner"] = owner_of(key)
        await self.app(scope, receive, send)


def create_app(config: ServerConfig) -> FastAPI:
    """The server's app: Tinker protocol under /api/v1, OpenAI-compatible under /v1."""
    from posttrain.server.openai_api import create_openai_router
    from posttrain.server.tinker_api import ORDERED_ROUTES, create_tinker_router, release_turn
    from posttrain.server.tinker_info import create_info_router

    config.storage_dir.mkdir(parents=True, exist_ok=True)
    store = Store(config.db_path)
    runtime = Runtime(config, store)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        runtime.start(asyncio.get_running_loop())
        yield
        runtime.close()
        store.close()

    app = FastAPI(title="posttrain serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.runtime = runtime
    app.include_router(create_tinker_router(runtime))
    app.include_router(create_info_router(runtime))
    app.include_router(create_openai_router(runtime))

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own answer echoes the input, which may be huge or not encodable as JSON.
        who = getattr(request.state, "owner", None)
        if request.url.path in ORDERED_ROUTES and who is not None and isinstance(exc.body, dict):
            release_turn(runtime, who, exc.body.get("model_id"), exc.body.get("seq_id"))
        return JSONResponse({"detail": validation_detail(exc)}, 422)

    openapi = app.openapi

    def openapi_with_our_422() -> dict[str, Any]:
        schema = openapi()
        # What `invalid_request` answers, not FastAPI's list of errors.
        detail = {"type": "string", "description": "each invalid field and what is wrong"}
        schema["components"]["schemas"]["HTTPValidationError"] = {
            "type": "object",
            "properties": {"detail": detail},
            "required": ["detail"],
        }
        return schema

    app.openapi = openapi_with_our_422

    # The last added runs first: keys are checked before anything else is looked at, and the
    # error boundary wraps everything.
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    app.add_middleware(ApiKeyAuth, keys=config.api_keys)
    app.add_middleware(ErrorBoundary)
    return app
