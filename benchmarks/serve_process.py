"""Start `posttrain serve` as a subprocess on a free loopback port, for the server benchmarks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
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
    pid: int


@contextmanager
def serve(base_model: Path, storage: Path, threads: int) -> Iterator[str]:
    """The server's URL while it runs; torch in it uses `threads` threads (OMP_NUM_THREADS)."""
    with serve_process(base_model, storage, threads) as served:
        yield served.url


@contextmanager
def serve_process(
    base_model: Path, storage: Path, threads: int, extra: Sequence[str] = ()
) -> Iterator[Served]:
    """`serve`, with more command-line flags (`extra`), giving the server's pid too."""
    port = free_port()
    args = [sys.executable, "-m", "posttrain.cli.main", "serve", "--base-model", str(base_model)]
    args += ["--port", str(port), "--storage", str(storage), "--api-key", KEY, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    log = open(storage.parent / "server.log", "w")  # noqa: SIM115 - the child writes to it
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"posttrain serve did not start: see {log.name}")
            try:
                if httpx.get(f"{url}/healthz", headers={"X-API-Key": KEY}).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield Served(url, process.pid)
    finally:
        process.terminate()
        process.wait(30)
        log.close()
