"""Per-token entropies from the sampler: the formula, the chunking, and where they go.

Tolerance: everything runs in float32. A chunk of rows sees exactly the ops the whole tensor
would (the softmax is per row), so chunked and unchunked agree to the last bit. Against a
float64 full-softmax reference, float32 rounding of a sum over V terms each < 1 leaves ~1e-6
on entropies <= log V ~ 10 (observed <= 4e-6 at V = 32k); the sampler's KV-cached logits differ from a
full forward's by the summation order only (~1e-6 on logprobs, `test_sampler.py`). 1e-5 covers
both; a wrong temperature, position or distribution moves an entropy by >= 1e-2.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import PreTrainedModel

from posttrain.clients.create import create_training_client
from posttrain.clients.tinker import to_tinker_sampling_params
from posttrain.data.trajectories import TokenSegment
from posttrain.engine.decode.entropy import sampling_entropies
from posttrain.engine.decode.sampler import Sampler
from posttrain.models.load import load_hf_model, load_tokenizer
from posttrain.rollouts.builder import TrajectoryBuilder
from posttrain.types import ModelInput, SampledSequence, SamplingParams

ATOL = 1e-5  # see the module docstring
PROMPTS = [[256, 72, 105, 33], [7, 8], [256, 10, 20, 30, 40, 50, 60, 70, 80, 90]]


def naive_entropy(logits_NV: torch.Tensor) -> torch.Tensor:
    """-sum p log p over the full softmax, in float64, one row at a time."""
    rows = []
    for row_V in logits_NV.double():
        p_V = row_V.softmax(-1)
        rows.append(-(p_V[p_V > 0] * p_V[p_V > 0].log()).sum())
    return torch.stack(rows)


def test_entropy_by_hand() -> None:
    # Uniform over 4: log 4. One token certain (others -inf): 0. Two equal and two impossible:
    # log 2. p = (1/2, 1/4, 1/4) from logits (log 2, 0, 0) + c: 1/2 log 2 + 2 * 1/4 log 4
    # = 1.5 log 2.
    inf = math.inf
    logits = torch.tensor(
        [
            [0.0, 0.0, 0.0, 0.0],
            [3.0, -inf, -inf, -inf],
            [1.0, 1.0, -inf, -inf],
            [math.log(2) + 5, 5.0, 5.0, -inf],
        ]
    )
    expected = torch.tensor([math.log(4), 0.0, math.log(2), 1.5 * math.log(2)])
    torch.testing.assert_close(sampling_entropies(logits), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("chunk_rows", [1, 7, 64, 1000])
def test_chunked_entropy_matches_the_full_softmax(chunk_rows: int) -> None:
    gen = torch.Generator().manual_seed(0)
    logits_NV = torch.randn(37, 32_000, generator=gen) * 3
    logits_NV[5, 100:] = -math.inf  # a truncated row
    got = sampling_entropies(logits_NV, chunk_rows=chunk_rows)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), naive_entropy(logits_NV), atol=ATOL, rtol=0)
    # Rows are independent: chunking changes no bit.
    assert torch.equal(got, sampling_entropies(logits_NV, chunk_rows=37))


def test_bad_entropy_inputs() -> None:
    with pytest.raises(ValueError, match=r"scaled_AV must be \[rows, vocab\]"):
        sampling_entropies(torch.zeros(3))
    with pytest.raises(ValueError, match="chunk_rows must be an int >= 1"):
        sampling_entropies(torch.zeros(2, 3), chunk_rows=0)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> PreTrainedModel:
    return load_hf_model(tiny_model_dir, dtype="float32").eval()


@pytest.fixture(scope="module")
def sampler(model: nn.Module, tiny_model_dir: Path) -> Sampler:
    return Sampler(model, load_tokenizer(tiny_model_dir))


def teacher_forced_entropies(
    model: nn.Module, prompt: list[int], completion: list[int], temperature: float
) -> list[float]:
    """Entropy of softmax(logits / T) (T=0: of softmax(logits)) at each completion position."""
    with torch.no_grad():
        logits_TV = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    scaled_TV = logits_TV / (temperature or 1.0)
    at = range(len(prompt) - 1, len(prompt) - 1 + len(completion))
    return naive_entropy(scaled_TV[list(at)]).tolist()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=12, seed=1, temperature=1.0, stop=[], entropies=True),
        # Truncation is not folded in: the entropy is of the untruncated distribution.
        SamplingParams(
            max_tokens=12, seed=2, temperature=0.7, top_k=5, top_p=0.9, stop=[], entropies=True
        ),
        SamplingParams(max_tokens=12, temperature=0.0, stop=[], entropies=True),
    ],
    ids=["t1", "t0.7-topk-topp", "greedy"],
)
def test_sampled_entropies_match_a_full_forward(
    model: nn.Module, sampler: Sampler, params: SamplingParams
) -> None:
    responses = sampler.sample(PROMPTS, 2, params)
    for prompt, response in zip(PROMPTS, responses, strict=True):
        for seq in response.sequences:
            assert seq.entropies is not None and len(seq.entropies) == len(seq.tokens)
            expected = teacher_forced_entropies(model, prompt, seq.tokens, params.temperature)
            assert max(abs(a - b) for a, b in zip(seq.entropies, expected, strict=True)) < ATOL
    # Asking for entropies changes nothing else; not asking returns none.
    plain = sampler.sample(PROMPTS, 2, SamplingParams(**{**params.__dict__, "entropies": False}))
    for with_h, without in zip(responses, plain, strict=True):
        for a, b in zip(with_h.sequences, without.sequences, strict=True):
            assert (a.tokens, a.logprobs, b.entropies) == (b.tokens, b.logprobs, None)


def entropies_of(responses) -> list[list[float]]:
    return [seq.entropies for r in responses for seq in r.sequences]


def test_entropies_do_not_depend_on_the_batch(sampler: Sampler) -> None:
    params = SamplingParams(max_tokens=10, seed=5, stop=[], entropies=True)
    alone = [sampler.sample([p], 2, params, first_index=i) for i, p in enumerate(PROMPTS)]
    together = sampler.sample(PROMPTS, 2, params)
    for one, batched in zip(alone, together, strict=True):
        assert [s.tokens for s in one[0].sequences] == [s.tokens for s in batched.sequences]
        # Left padding changes the matmul shapes, so rounding only: see the module docstring.
        for a, b in zip(entropies_of(one), entropies_of([batched]), strict=True):
            assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < ATOL


def test_entropies_do_not_depend_on_data_parallel_sharding(tiny_model_dir, tmp_path) -> None:
    params = SamplingParams(max_tokens=8, seed=9, stop=[], entropies=True)
    prompts = [ModelInput.from_ints(p) for p in PROMPTS]
    got = {}
    for workers in (1, 2):
        client = create_training_client(
            tiny_model_dir, lora_rank=4, storage_dir=tmp_path / str(workers), num_workers=workers
        )
        got[workers] = client.sample_many(prompts, 2, params).result()
    for one, two in zip(got[1], got[2], strict=True):
        assert [s.tokens for s in one.sequences] == [s.tokens for s in two.sequences]
        for a, b in zip(entropies_of([one]), entropies_of([two]), strict=True):
            assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < ATOL


def test_entropies_reach_the_trajectory(tiny_model_dir) -> None:
    builder = TrajectoryBuilder(load_tokenizer(tiny_model_dir))
    builder.prompt({"role": "user", "content": "hi"})
    builder.completion(SampledSequence("length", [72, 105], [-0.5, -1.0], [2.0, 0.25]))
    segment = builder.build(1.0).segments[-1]
    assert segment.trainable and segment.entropies == (2.0, 0.25)
    builder.completion(SampledSequence("length", [33], [-0.1]))  # sampled without
    assert builder.build(1.0).segments[-1].entropies is None


def test_bad_entropy_fields() -> None:
    with pytest.raises(ValueError, match=r"TokenSegment.entropies has 1 values for 2 tokens"):
        TokenSegment((1, 2), True, (-0.1, -0.2), entropies=(0.3,))
    with pytest.raises(ValueError, match=r"SamplingParams\.entropies must be true or false"):
        SamplingParams(entropies=1)  # pyright: ignore[reportArgumentType]
    # The Tinker protocol has no field for them: refused before any request, with the way out.
    with pytest.raises(ValueError, match=r"entropies=True: the Tinker protocol.*LocalBackend"):
        to_tinker_sampling_params(SamplingParams(entropies=True))
