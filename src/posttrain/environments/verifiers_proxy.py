"""The loopback proxy between a `verifiers` environment and a posttrain OpenAI endpoint, which
keeps every response with its exact tokens.

verifiers (0.4.0) sends a rollout's model calls through its own HTTP client and keeps only the
parsed messages on its trace: the token ids and logprobs of each response are dropped. So the
adapter points verifiers at this proxy, which forwards each request to the model's endpoint and
records the request and the whole response under the rollout's `X-Session-ID` header (the
verifiers trace id, which its client sends with every call of a rollout). On the way it:

- asks for token ids (`return_token_ids`, as `model.openai_client()` does), which also brings
  the sampled tokens' logprobs;
- turns a seeded request's `seed` into the seed of that turn of the rollout, so the turns of one
  rollout do not repeat each other's draws;
- answers a streamed request (`stream=True`, as verifiers' built-in chat harnesses ask) with the
  whole response as one event: posttrain's endpoint samples whole responses.

Only requests carrying the proxy's own key (a random header, set in the verifiers client
config) are forwarded, so no other local process borrows the endpoint through it.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from posttrain.data.checks import expect

if TYPE_CHECKING:  # aiohttp and httpx come with verifiers (the `verifiers` extra)
    import httpx
    from aiohttp import web

KEY_HEADER = "X-Posttrain-Proxy-Key"
SESSION_HEADER = "X-Session-ID"  # verifiers' per-rollout header (its SESSION_ID_HEADER)
ROUTES = ("chat/completions", "completions")  # what posttrain's endpoints sample


class Endpoint(Protocol):
    """Where a model is served (posttrain's `OpenAIEndpoint`)."""

    @property
    def base_url(self) -> str: ...
    @property
    def api_key(self) -> str: ...
    @property
    def model_name(self) -> str: ...


@dataclass(frozen=True)
class Exchange:
    """One model call of a rollout: the request as forwarded, the response as returned."""

    request: Mapping[str, object]
    response: Mapping[str, object]


@dataclass
class _Session:
    requests: int = 0
    exchanges: list[Exchange] = field(default_factory=list[Exchange])


def turn_seed(seed: int, turn: int) -> int:
    """A rollout's turn `turn` seed: its own stream, derived from the rollout's seed."""
    digest = hashlib.blake2b(f"{seed}:turn:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


class RecordingProxy:
    """`async with RecordingProxy(endpoint) as proxy`: serves on `proxy.base_url` (loopback)
    until the block ends; `proxy.take(session)` gives a rollout's exchanges in order."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.key = secrets.token_urlsafe(16)
        self.base_url = ""
        self._sessions: dict[str, _Session] = {}
        self._runner: web.AppRunner | None = None
        self._http: httpx.AsyncClient | None = None

    async def __aenter__(self) -> RecordingProxy:
        import httpx
        from aiohttp import web

        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/v1/{path:.*}", self._handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        self._runner = runner
        self.base_url = f"http://127.0.0.1:{port}/v1"
        # No read timeout: a turn takes as long as sampling it does (verifiers bounds rollouts).
        self._http = httpx.AsyncClient(
            base_url=self.endpoint.base_url.rstrip("/"),
            headers={"Authorization": f"Bearer {self.endpoint.api_key}"},
            timeout=httpx.Timeout(30.0, read=None),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._http is not None:
            await self._http.aclose()
        if self._runner is not None:
            await self._runner.cleanup()

    def take(self, session: str) -> list[Exchange]:
        """The exchanges recorded for `session` (a verifiers trace id), forgotten here."""
        found = self._sessions.pop(session, None)
        return found.exchanges if found is not None else []

    async def _handle(self, request: web.Request) -> web.Response:
        from aiohttp import web

        assert self._http is not None  # serving: entered
        if not secrets.compare_digest(request.headers.get(KEY_HEADER, ""), self.key):
            return _error(401, f"missing or wrong {KEY_HEADER} header")
        path = request.match_info["path"]
        if request.method != "POST":
            upstream = await self._http.request(request.method, f"/{path}")
            return web.Response(
                status=upstream.status_code,
                body=upstream.content,
                content_type="application/json",
            )
        if path not in ROUTES:
            return _error(
                404,
                f"posttrain's endpoint serves /v1/chat/completions and /v1/completions, not "
                f"/v1/{path}: use a verifiers harness that speaks the chat-completions dialect",
            )
        body = await request.json()
        session = request.headers.get(SESSION_HEADER)
        stream = bool(body.pop("stream", False))
        body.pop("stream_options", None)
        body.setdefault("return_token_ids", True)  # as model.openai_client() asks
        if session is not None:
            state = self._sessions.setdefault(session, _Session())
            if isinstance(body.get("seed"), int):
                body["seed"] = turn_seed(body["seed"], state.requests)
            state.requests += 1
        upstream = await self._http.post(f"/{path}", json=body)
        if upstream.status_code != 200:
            return web.Response(
                status=upstream.status_code, body=upstream.content, content_type="application/json"
            )
        data = upstream.json()
        if session is not None:
            self._sessions[session].exchanges.append(Exchange(body, data))
        if not stream:
            return web.json_response(data)
        return web.Response(
            body=_stream_events(data, chat=path == "chat/completions"),
            content_type="text/event-stream",
        )


def _error(status: int, message: str) -> web.Response:
    from aiohttp import web

    body = {"error": {"message": message, "type": "invalid_request_error", "code": status}}
    return web.json_response(body, status=status)


def _stream_events(data: Mapping[str, object], *, chat: bool) -> bytes:
    """A whole response as the one event of a stream, then the end of the stream."""
    chunk: dict[str, object] = dict(data)
    if chat:
        chunk["object"] = "chat.completion.chunk"
        choices: list[dict[str, object]] = []
        for choice in expect(data.get("choices") or [], list, "the response's choices"):
            delta = dict(choice.get("message") or {})
            calls = delta.get("tool_calls")
            if calls:  # a streamed tool call carries its position
                delta["tool_calls"] = [{**call, "index": i} for i, call in enumerate(calls)]
            choices.append({**choice, "delta": delta})
            choices[-1].pop("message", None)
        chunk["choices"] = choices
    return f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
