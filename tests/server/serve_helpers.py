"""Start and stop `posttrain serve` as a real subprocess on a free loopback port, or serve an app
in this process (`serving`) where a test needs to reach into the runtime."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:  # the server's extras are not needed to import these helpers
    from fastapi import FastAPI

    from posttrain.server.config import ServerConfig

KEY = "tml-test-key-one"
OTHER_KEY = "tml-test-key-two"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerProcess:
    url: str
    process: subprocess.Popen[str]
    log: Path
    storage: Path

    def checkpoint_dir(self, tinker_path: str) -> Path:
        """Where this server keeps a `save_state` checkpoint (tinker://MODEL/weights/NAME)."""
        model_id, kind, name = tinker_path.removeprefix("tinker://").split("/")
        assert kind == "weights", tinker_path
        return self.storage / "runs" / model_id.replace(":", "_") / "checkpoints" / name

    def kill(self) -> None:
        """SIGKILL: no shutdown handler runs, as in a crash."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def start_server(
    base_model: Path | str, storage: Path, *extra: str, keys: tuple[str, ...] = (KEY, OTHER_KEY)
) -> ServerProcess:
    """Run `posttrain serve` and wait until /healthz answers (the first import of torch and
    transformers takes a few seconds)."""
    port = free_port()
    args = [sys.executable, "-m", "posttrain.cli.main", "serve", "--base-model", str(base_model)]
    args += ["--port", str(port), "--storage", str(storage), *extra]
    for key in keys:
        args += ["--api-key", key]
    log = storage.parent / f"{storage.name}-server-{port}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    handle = open(log, "w")  # noqa: SIM115 - the child writes to it for its whole life
    process = subprocess.Popen(args, stdout=handle, stderr=subprocess.STDOUT, env=env, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"posttrain serve exited with {process.returncode}: {log.read_text()}"
            )
        try:
            if (
                httpx.get(f"{url}/healthz", headers={"X-API-Key": keys[0]}, timeout=1).status_code
                == 200
            ):
                return ServerProcess(url, process, log, storage)
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"posttrain serve did not answer /healthz in 90 s: {log.read_text()}")


def post(server: ServerProcess, path: str, key: str | None = KEY, **kwargs) -> httpx.Response:
    """POST /api/v1/PATH with the key in X-API-Key (none if `key` is None)."""
    headers = dict(kwargs.pop("headers", {}))
    if key is not None:
        headers["X-API-Key"] = key
    return httpx.post(f"{server.url}/api/v1/{path}", headers=headers, timeout=30, **kwargs)


def result(server: ServerProcess, request_id: str, key: str = KEY) -> dict:
    """retrieve_future until the request is no longer pending."""
    while True:
        response = post(server, "retrieve_future", key, json={"request_id": request_id})
        assert response.status_code == 200, response.text
        body = response.json()
        if body.get("type") != "try_again":
            return body


def in_process_config(model_dir: Path, tmp_path: Path, **changes: Any) -> ServerConfig:
    """A server of the model at `model_dir` (named "tiny"), its state under `tmp_path`."""
    from posttrain.server.config import ServerConfig

    return ServerConfig(
        base_model="tiny",
        model_path=str(model_dir),
        db_path=tmp_path / "state.db",
        storage_dir=tmp_path / "storage",
        **changes,
    )


def assert_bit_equal(a: object, b: object) -> None:
    """Nested dicts and lists whose tensors are torch.equal (same dtype) and the rest =="""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            assert_bit_equal(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_bit_equal(x, y)
    else:
        assert a == b


@contextmanager
def serving(app: FastAPI) -> Iterator[str]:
    """`app` under uvicorn (lifespan on, so the runtime starts) in a thread, on a free port."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
