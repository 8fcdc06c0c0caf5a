"""The decoder on each family `make-tiny-model --arch` builds: Qwen3, Qwen3.5 (hybrid
linear attention), Gemma 3 and OLMo 3 (sliding-window and global layers, a 16-token window).
Greedy samples equal transformers' `generate` token for token, batched with left padding and
on prompts longer than the window; sampled logprobs equal the trainer's teacher-forced ones
(a LoRA client's `compute_logprobs`).

Tolerance: fp32, as test_sampler.py (cache vs one full forward: summation order only), 1e-5.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from transformers import PreTrainedModel

from posttrain.clients.create import create_training_client
from posttrain.engine.decode.sampler import Sampler
from posttrain.models.load import load_hf_model, load_tokenizer
from posttrain.models.tiny import TEST_SLIDING_WINDOW, make_tiny_model
from posttrain.types import ModelInput, SamplingParams

NEEDS = {"qwen3": "Qwen3Config", "qwen3_5": "Qwen3_5TextConfig", "gemma3": "Gemma3TextConfig"}
FAMILIES = [
    pytest.param(
        arch,
        marks=pytest.mark.skipif(
            not hasattr(transformers, NEEDS.get(arch, "Olmo3Config")),
            reason=f"this transformers has no {arch}",
        ),
    )
    for arch in ("qwen3", "qwen3_5", "gemma3", "olmo3")
]
# One prompt well past the 16-token window, one inside it, one at its edge.
PROMPTS = [
    [(7 * i + 3) % 250 for i in range(TEST_SLIDING_WINDOW + 14)],
    [7, 8, 9],
    [(5 * i + 1) % 250 for i in range(TEST_SLIDING_WINDOW)],
]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param)


def _generate(model: PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(  # pyright: ignore[reportCallIssue]
            torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


def test_greedy_equals_generate_past_the_window(family: Path):
    model = load_hf_model(family, dtype="float32").eval()
    sampler = Sampler(model, load_tokenizer(family))
    params = SamplingParams(max_tokens=12, temperature=0.0, stop=[])
    for prompt, response in zip(PROMPTS, sampler.sample(PROMPTS, 2, params), strict=True):
        expected = _generate(model, prompt, 12)
        assert [s.tokens for s in response.sequences] == [expected, expected], len(prompt)


def test_sampled_logprobs_equal_the_trainers(family: Path, tmp_path: Path):
    client = create_training_client(family, lora_rank=4, storage_dir=tmp_path)
    try:
        params = SamplingParams(max_tokens=8, seed=5, stop=[], temperature=1.0)
        for prompt in PROMPTS:
            response = client.sample(ModelInput.from_ints(prompt), 2, params).result()
            for seq in response.sequences:
                full = ModelInput.from_ints([*prompt, *seq.tokens])
                scored = client.compute_logprobs(full).result()[len(prompt) :]
                assert seq.logprobs is not None
                gap = max(abs(a - float(b or 0)) for a, b in zip(seq.logprobs, scored, strict=True))
                assert gap <= 1e-5, (len(prompt), gap)
    finally:
        client.close()
