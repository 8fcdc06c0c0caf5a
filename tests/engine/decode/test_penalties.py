"""min_p and the repetition, presence and frequency penalties in posttrain's sampler: by hand,
against transformers' `generate` (repetition penalty) and a naive decode without KV cache
(presence / frequency), and with logprobs that stay the teacher-forced, unpenalized ones.

Tolerance: as in test_sampler.py, float32 KV-cache decode vs one full forward, 1e-5.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import PreTrainedModel

from posttrain.engine.decode.sampler import Sampler
from posttrain.engine.decode.token_draw import TokenCounts, truncate_logits
from posttrain.models.load import load_hf_model, load_tokenizer
from posttrain.types import SamplingParams

ATOL = 1e-5
PROMPTS = [[256, 72, 105, 33], [7, 8, 7, 8], [256, 10, 20, 30, 40]]


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> PreTrainedModel:
    return load_hf_model(tiny_model_dir, dtype="float32").eval()


@pytest.fixture(scope="module")
def sampler(model: nn.Module, tiny_model_dir: Path) -> Sampler:
    return Sampler(model, load_tokenizer(tiny_model_dir))


def test_min_p_by_hand() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda m: (truncate_logits(logits, -1, 1.0, m) > float("-inf"))[0].tolist()  # noqa: E731
    # Kept: p >= min_p * 0.5, so 0.3 -> floor 0.15 keeps three, 0.7 -> floor 0.35 keeps one.
    assert kept(0.0) == [True] * 4
    assert kept(0.3) == [True, True, True, False]
    assert kept(0.7) == [True, False, False, False]
    assert kept(1.0) == [True, False, False, False]  # only the likeliest


def test_penalties_by_hand() -> None:
    logits_AV = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    counts = TokenCounts.build([[0]], 1, 5, params, torch.device("cpu"))
    assert counts is not None
    rows_A = torch.tensor([0])
    for token in (1, 1, 3):  # the output so far: token 1 twice, token 3 once
        counts.add(rows_A, torch.tensor([token]))
    got = counts.penalize(logits_AV, rows_A, params)[0].tolist()
    # token 0 (prompt): 2 / 2; token 1: -1 * 2 - 2 * 0.5 - 0.25; token 2 unseen; token 3:
    # 3 / 2 - 0.5 - 0.25; token 4 unseen.
    assert got == pytest.approx([1.0, -3.25, 0.5, 0.75, 1.0])
    assert TokenCounts.build([[0]], 1, 5, SamplingParams(), torch.device("cpu")) is None


def test_greedy_repetition_penalty_matches_generate(
    model: PreTrainedModel, sampler: Sampler
) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.0, stop=[], repetition_penalty=1.8)
    plain = sampler.sample(PROMPTS, 1, SamplingParams(max_tokens=10, temperature=0.0, stop=[]))
    responses = sampler.sample(PROMPTS, 1, params)
    for prompt, response in zip(PROMPTS, responses, strict=True):
        with torch.no_grad():
            ref = model.generate(  # pyright: ignore[reportCallIssue]
                torch.tensor([prompt]),
                max_new_tokens=10,
                min_new_tokens=10,
                do_sample=False,
                repetition_penalty=1.8,
            )
        (seq,) = response.sequences
        assert seq.tokens == ref[0, len(prompt) :].tolist()
        _assert_teacher_forced(model, prompt, seq.tokens, seq.logprobs, 1.0)
    assert [r.sequences[0].tokens for r in responses] != [r.sequences[0].tokens for r in plain]


def _naive_greedy(model: nn.Module, prompt: list[int], params: SamplingParams) -> list[int]:
    """One full forward per token (no cache), penalties from a plain count of the output."""
    out: list[int] = []
    for _ in range(params.max_tokens or 0):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + out])).logits[0, -1].float()
        for token in set(out):
            n = out.count(token)
            logits[token] -= params.frequency_penalty * n + params.presence_penalty
        out.append(int(logits.argmax()))
    return out


def test_greedy_presence_and_frequency_match_a_naive_decode(
    model: nn.Module, sampler: Sampler
) -> None:
    params = SamplingParams(
        max_tokens=10, temperature=0.0, stop=[], presence_penalty=1.5, frequency_penalty=0.7
    )
    plain = SamplingParams(max_tokens=10, temperature=0.0, stop=[])
    responses = sampler.sample(PROMPTS, 2, params)
    for prompt, response in zip(PROMPTS, responses, strict=True):
        expected = _naive_greedy(model, prompt, params)
        assert [s.tokens for s in response.sequences] == [expected, expected]
    unpenalized = sampler.sample(PROMPTS, 1, plain)
    assert [r.sequences[0].tokens for r in responses] != [
        r.sequences[0].tokens for r in unpenalized
    ]


def test_sampled_tokens_keep_unpenalized_logprobs_and_batch_as_alone(
    model: nn.Module, sampler: Sampler
) -> None:
    params = SamplingParams(
        max_tokens=8,
        seed=3,
        stop=[],
        temperature=0.8,
        min_p=0.05,
        repetition_penalty=1.3,
        presence_penalty=0.4,
        frequency_penalty=0.2,
    )
    together = sampler.sample(PROMPTS, 2, params)
    for i, (prompt, response) in enumerate(zip(PROMPTS, together, strict=True)):
        alone = sampler.sample([prompt], 2, params, first_index=i)[0]
        assert [s.tokens for s in alone.sequences] == [s.tokens for s in response.sequences]
        for seq in response.sequences:
            _assert_teacher_forced(model, prompt, seq.tokens, seq.logprobs, 0.8)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("min_p", 1.5, "SamplingParams.min_p must be in [0, 1], got 1.5"),
        (
            "repetition_penalty",
            0.0,
            "SamplingParams.repetition_penalty must be a finite number > 0",
        ),
        ("presence_penalty", 2.5, "SamplingParams.presence_penalty must be in [-2, 2], got 2.5"),
        ("frequency_penalty", math.nan, "SamplingParams.frequency_penalty must be in [-2, 2]"),
    ],
)
def test_bad_values_name_the_field(field: str, value: float, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**{field: value})  # pyright: ignore[reportArgumentType]


def _assert_teacher_forced(
    model: nn.Module, prompt: list[int], tokens: list[int], logprobs: list[float] | None, t: float
) -> None:
    """The reported logprobs are log_softmax(logits / t) of a full forward: no penalty in."""
    assert logprobs is not None
    with torch.no_grad():
        logits_TV = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    logp_TV = (logits_TV / t).log_softmax(-1)
    want = [logp_TV[len(prompt) - 1 + k, tok].item() for k, tok in enumerate(tokens)]
    assert max(abs(a - b) for a, b in zip(logprobs, want, strict=True)) <= ATOL
