"""The app's error boundary, in process: an unexpected exception answers a generic 500 with an
error id, the details go to the server's log under that id, and the connection stays open."""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi.testclient import TestClient

from posttrain.server.app import create_app
from posttrain.server.config import ServerConfig


def test_internal_errors_answer_an_id_and_log_the_details(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = ServerConfig(
        base_model="tiny",
        model_path=str(tiny_model_dir),
        db_path=tmp_path / "state.db",
        storage_dir=tmp_path / "storage",
    )
    app = create_app(config)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("disk full at /srv/posttrain/runs/session-of-someone-else")

    with caplog.at_level(logging.ERROR), TestClient(app, raise_server_exceptions=False) as client:
        response = client.get("/boom", headers={"X-API-Key": "tml-any"})
        # The OpenAI-compatible routes are mounted (no longer skipped on ImportError).
        models = client.get("/v1/models", headers={"X-API-Key": "tml-any"})
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
    assert response.status_code == 500
    match = re.fullmatch(
        r"internal server error \(error id ([0-9a-f]{12})\)", response.json()["detail"]
    )
    assert match is not None, response.text
    assert "someone-else" not in response.text and "RuntimeError" not in response.text
    logged = [r for r in caplog.records if match.group(1) in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None
    assert "someone-else" in str(logged[0].exc_info[1])


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    """One HTTP/1.1 response (status, body) from `sock`, read up to its Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed after {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head, re.IGNORECASE).group(1))  # pyright: ignore[reportOptionalMemberAccess]
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        body += chunk
    return int(head.split()[1]), body


def test_a_500_keeps_the_connection_open(tiny_model_dir: Path, tmp_path: Path) -> None:
    # Starlette's handler re-raises after answering 500, and uvicorn then closes the connection:
    # the SDK took that for a network failure. The error boundary ends the request there.
    config = ServerConfig(
        base_model="tiny",
        model_path=str(tiny_model_dir),
        db_path=tmp_path / "state.db",
        storage_dir=tmp_path / "storage",
    )
    app = create_app(config)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("boom")

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            for path, status in (("/boom", 500), ("/healthz", 200), ("/boom", 500)):
                request = f"GET {path} HTTP/1.1\r\nHost: x\r\nX-API-Key: tml-any\r\n\r\n"
                sock.sendall(request.encode())
                got, body = _read_response(sock)
                assert got == status, body
            assert b"internal server error (error id" in body
    finally:
        server.should_exit = True
        thread.join(10)
