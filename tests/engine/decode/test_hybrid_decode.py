"""The sampler on a hybrid model, Qwen3.5's text model (`make_tiny_model(arch="qwen3_5")`: one
GatedDeltaNet linear-attention layer and one full-attention layer, random weights): its cache holds a convolution and a recurrent
state per row beside the KV layer's keys and values. A prompt's state is computed once and
repeated per sample, and rows that finish leave every layer (`kv_cache.repeat_rows` /
`select_rows`), so greedy samples equal transformers' `generate` and logprobs a full forward.

Tolerance: fp32, as test_sampler.py (cache vs one full forward: summation order only), 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import PreTrainedModel

from posttrain.engine.decode.sampler import Sampler, SampleRequest
from posttrain.models.load import load_hf_model, load_tokenizer
from posttrain.models.tiny import make_tiny_model, tiny_model_path
from posttrain.types import SamplingParams

if not hasattr(transformers, "Qwen3_5TextConfig"):
    pytest.skip("this transformers has no Qwen3.5", allow_module_level=True)

PROMPTS = [[256, 72, 105, 33, 9, 40, 41, 42, 43, 44, 45], [7, 8], [256, 10, 20, 30, 40, 50]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedModel:
    path = make_tiny_model(tmp_path_factory.mktemp("qwen3_5"), arch="qwen3_5")
    return load_hf_model(path, dtype="float32").eval()


@pytest.fixture(scope="module")
def sampler(model: PreTrainedModel) -> Sampler:
    return Sampler(model, load_tokenizer(tiny_model_path("tiny")))


def _generate(model: PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(  # pyright: ignore[reportCallIssue]
            torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


def test_greedy_batched_with_samples_equals_generate(model: PreTrainedModel, sampler: Sampler):
    params = SamplingParams(max_tokens=10, temperature=0.0, stop=[])
    for prompt, response in zip(PROMPTS, sampler.sample(PROMPTS, 2, params), strict=True):
        expected = _generate(model, prompt, 10)
        assert [s.tokens for s in response.sequences] == [expected, expected]


def test_rows_that_finish_early_leave_every_layer(model: PreTrainedModel, sampler: Sampler):
    """Requests of 3, 9 and 6 tokens in one batch: the batch shrinks twice mid-decode."""
    lengths = (3, 9, 6)
    requests = [
        SampleRequest([p], SamplingParams(max_tokens=n, temperature=0.0, stop=[]))
        for p, n in zip(PROMPTS, lengths, strict=True)
    ]
    batched = sampler.sample_batched(requests, 2)
    for prompt, n, (response,) in zip(PROMPTS, lengths, batched, strict=True):
        assert [s.tokens for s in response.sequences] == [_generate(model, prompt, n)] * 2


def test_sampled_logprobs_equal_a_full_forward(model: PreTrainedModel, sampler: Sampler):
    params = SamplingParams(max_tokens=8, seed=3, stop=[], temperature=0.7)
    for prompt, response in zip(PROMPTS, sampler.sample(PROMPTS, 2, params), strict=True):
        for seq in response.sequences:
            assert seq.logprobs is not None
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + seq.tokens])).logits[0].float()
            logp = (logits / 0.7).log_softmax(-1)
            want = [logp[len(prompt) - 1 + k, t].item() for k, t in enumerate(seq.tokens)]
            assert max(abs(a - b) for a, b in zip(seq.logprobs, want, strict=True)) <= 1e-5
