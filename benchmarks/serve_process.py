"""Start `posttrain serve` as a subprocess on a free loopback port, for the server benchmarks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

KEY = "tml-benchmark"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class Served:
    url: str
    process: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.process.pid


@contextmanager
def serve(base_model: Path, storage: Path, threads: int) -> Iterator[str]:
    """The server's URL while it runs; torch in it uses `threads` threads (OMP_NUM_THREADS)."""
    with serve_process(base_model, storage, threads) as served:
        yield served.url


@contextmanager
def serve_process(
    base_model: Path,
    storage: Path,
    threads: int | None,
    extra: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Iterator[Served]:
    """`serve`, with more command-line flags (`extra`), giving the server's process too (to
    read its CPU time and memory). `threads` None leaves OMP_NUM_THREADS unset, so the server
    chooses; `env` adds to its environment (e.g. PYTHONPATH to serve another checkout's
    sources)."""
    port = free_port()
    args = [sys.executable, "-m", "posttrain.cli.main", "serve", "--base-model", str(base_model)]
    args += ["--port", str(port), "--storage", str(storage), "--api-key", KEY, *extra]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    env.pop("OMP_NUM_THREADS", None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    log = open(storage.parent / "server.log", "w")  # noqa: SIM115 - the child writes to it
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                log.flush()
                tail = Path(log.name).read_text()[-3000:]
                raise RuntimeError(f"posttrain serve did not start; its log ends:\n{tail}")
            try:
                if httpx.get(f"{url}/healthz", headers={"X-API-Key": KEY}).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield Served(url, process)
    finally:
        process.terminate()
        process.wait(30)
        log.close()
