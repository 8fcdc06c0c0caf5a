"""Tests for the KV-cache sampler on the tiny qwen2 model.

Logprob tolerance: everything runs in float32. The sampler computes each step's logits with a KV
cache (prompt once, then one token at a time, left-padded in a batch), the reference with one
forward over the whole unpadded sequence; the two differ only in the summation order of the
matmuls and of the attention softmax. That rounding is relative to the logits' size (|logits| <= 4
here, so the LoRA perturbation is kept small too) and moves logprobs by ~1e-6 (observed <= 1e-6).
1e-5 absolute leaves room for that and catches any real error (a wrong position id, mask,
temperature or adapter moves them by >= 1e-2).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from posttrain.engine.decode import kv_cache
from posttrain.engine.decode.sampler import Sampler
from posttrain.engine.decode.token_draw import choose_tokens, truncate_logits
from posttrain.models.load import LoraSettings, apply_lora, load_hf_model, load_tokenizer
from posttrain.types import SampledSequence, SamplingParams

ATOL = 1e-5  # see the module docstring
PROMPTS = [[256, 72, 105, 33], [7, 8], [256, 10, 20, 30, 40, 50, 60, 70, 80, 90]]


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> PreTrainedModel:
    return load_hf_model(tiny_model_dir, dtype="float32").eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def sampler(model: nn.Module, tokenizer: PreTrainedTokenizerBase) -> Sampler:
    return Sampler(model, tokenizer)


def teacher_forced(
    model: nn.Module, prompt: list[int], completion: list[int], temperature: float = 1.0
) -> list[float]:
    """log_softmax(logits / temperature) of each completion token from one full forward pass."""
    with torch.no_grad():
        logits_TV = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    logp_TV = (logits_TV / temperature).log_softmax(-1)
    return [logp_TV[len(prompt) - 1 + k, t].item() for k, t in enumerate(completion)]


def max_logprob_error(model: nn.Module, prompt: list[int], seq: SampledSequence, t: float) -> float:
    assert seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens)
    expected = teacher_forced(model, prompt, seq.tokens, t)
    return max(abs(a - b) for a, b in zip(seq.logprobs, expected, strict=True))


@contextlib.contextmanager
def biased(model: PreTrainedModel, token_ids: list[int], bias: float = 50.0) -> Iterator[None]:
    """Add `bias` to the logits of `token_ids`: decoding then emits (almost) only those."""
    bias_V = torch.zeros(model.config.vocab_size)
    bias_V[token_ids] = bias
    head = model.get_output_embeddings()
    assert head is not None
    handle = head.register_forward_hook(lambda m, i, out: out + bias_V)
    try:
        yield
    finally:
        handle.remove()


# A stop set covering 32 of the 260 tokens: at temperature 1 sequences stop at different steps,
# so rows leave the batch (and the KV cache) while the others go on.
MANY_STOPS = list(range(0, 256, 8))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sample_logprobs_match_teacher_forcing(
    model: nn.Module, sampler: Sampler, temperature: float
) -> None:
    params = SamplingParams(max_tokens=12, seed=0, stop=MANY_STOPS, temperature=temperature)
    responses = sampler.sample(PROMPTS, 4, params)
    assert [len(r.sequences) for r in responses] == [4, 4, 4]
    lengths = set()
    for prompt, response in zip(PROMPTS, responses, strict=True):
        for seq in response.sequences:
            assert max_logprob_error(model, prompt, seq, temperature) <= ATOL
            lengths.add(len(seq.tokens))
            stops_at = [k for k, t in enumerate(seq.tokens) if t in MANY_STOPS]
            if seq.stop_reason == "stop":
                assert stops_at == [len(seq.tokens) - 1]
            else:
                assert stops_at == [] and len(seq.tokens) == 12
    assert len(lengths) >= 3  # rows really finished at different steps


def test_kv_cache_growth(
    model: nn.Module, sampler: Sampler, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With 4 spare positions the cache buffers grow (double) several times mid-generation,
    # also after finished rows have left the batch.
    monkeypatch.setattr(kv_cache, "_CACHE_STEP", 4)
    params = SamplingParams(max_tokens=40, seed=2, stop=MANY_STOPS[:8])
    responses = sampler.sample(PROMPTS, 3, params)
    assert max(len(s.tokens) for r in responses for s in r.sequences) > 2 * len(PROMPTS[2]) + 4
    for prompt, response in zip(PROMPTS, responses, strict=True):
        for seq in response.sequences:
            assert max_logprob_error(model, prompt, seq, 1.0) <= ATOL


@pytest.mark.parametrize("wrapper", ["apply_lora", "plain_peft"])
def test_lora_logprobs_use_current_adapter_weights(
    model: PreTrainedModel, tokenizer, wrapper: str
) -> None:
    if wrapper == "apply_lora":  # PeftModelForCausalLM on every linear layer and the unembedding
        peft_model = apply_lora(copy.deepcopy(model), LoraSettings(rank=4, dropout=0.5))
    else:  # a PeftModel without a task type
        lora_config = LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.5, target_modules=["q_proj", "v_proj", "lm_head"]
        )
        peft_model = get_peft_model(copy.deepcopy(model), lora_config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.03, generator=torch.Generator().manual_seed(len(name)))
    weights_before = {k: v.clone() for k, v in peft_model.state_dict().items()}
    peft_model.train()  # sampling must switch dropout off, then restore training mode
    sampler = Sampler(peft_model, tokenizer)
    params = SamplingParams(max_tokens=10, seed=1, stop=[])
    responses = sampler.sample(PROMPTS[:2], 3, params)
    assert peft_model.training
    peft_model.eval()
    for prompt, response in zip(PROMPTS, responses, strict=False):
        for seq in response.sequences:
            assert max_logprob_error(peft_model, prompt, seq, 1.0) <= ATOL
            # The adapter matters: the base model gives clearly different logprobs.
            assert max_logprob_error(model, prompt, seq, 1.0) > 1e-2
    # Nothing was merged or unmerged: every weight (base and adapter) is bit-identical.
    after = peft_model.state_dict()
    assert all(torch.equal(weights_before[k], after[k]) for k in weights_before)
    lp = sampler.compute_logprobs(PROMPTS[0])
    assert lp[0] is None
    expected = teacher_forced(peft_model, PROMPTS[0][:1], PROMPTS[0][1:])
    assert max(abs(a - b) for a, b in zip(lp[1:], expected, strict=True)) <= ATOL  # pyright: ignore[reportOptionalOperand]


def test_compute_logprobs_match_teacher_forcing(model: nn.Module, sampler: Sampler) -> None:
    for prompt in PROMPTS:
        lp = sampler.compute_logprobs(prompt)
        assert len(lp) == len(prompt) and lp[0] is None
        expected = teacher_forced(model, prompt[:1], prompt[1:])
        assert max(abs(a - b) for a, b in zip(lp[1:], expected, strict=True)) <= ATOL  # pyright: ignore[reportOptionalOperand]
    assert sampler.compute_logprobs([5]) == [None]
    params = SamplingParams(max_tokens=2, seed=0)
    responses = sampler.sample(PROMPTS, 1, params, include_prompt_logprobs=True)
    assert [r.prompt_logprobs for r in responses] == [sampler.compute_logprobs(p) for p in PROMPTS]


def tokens_of(responses) -> list[list[int]]:
    return [seq.tokens for r in responses for seq in r.sequences]


def test_seeds(sampler: Sampler) -> None:
    # 70 tokens > the 64 uniforms drawn per generator at a time: the refill is covered too.
    params = SamplingParams(max_tokens=70, seed=123, stop=[])
    first = tokens_of(sampler.sample(PROMPTS[:1], 2, params))
    assert first == tokens_of(sampler.sample(PROMPTS[:1], 2, params))
    assert first[0] != first[1]  # each sample has its own stream
    other_seed = SamplingParams(max_tokens=70, seed=124, stop=[])
    assert first != tokens_of(sampler.sample(PROMPTS[:1], 2, other_seed))
    # More samples and a longer prompt after it (so this one is left-padded) change nothing.
    mixed = sampler.sample([PROMPTS[0], PROMPTS[2]], 3, params)
    assert tokens_of(mixed[:1])[:2] == first
    # A batch split across workers: the second half passes its offset and gets the same samples.
    assert tokens_of(sampler.sample([PROMPTS[2]], 3, params, first_index=1)) == tokens_of(mixed[1:])
    assert tokens_of(sampler.sample([PROMPTS[2]], 3, params)) != tokens_of(mixed[1:])
    unseeded = SamplingParams(max_tokens=70, seed=None, stop=[])
    assert tokens_of(sampler.sample(PROMPTS[:1], 2, unseeded)) != tokens_of(
        sampler.sample(PROMPTS[:1], 2, unseeded)
    )


def test_greedy_matches_generate(model: PreTrainedModel, sampler: Sampler) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, stop=[])
    batched = sampler.sample(PROMPTS, 2, params)
    for prompt, response in zip(PROMPTS, batched, strict=True):
        with torch.no_grad():
            # PreTrainedModel's stubs lack GenerationMixin; every causal LM class has it.
            ref = model.generate(  # pyright: ignore[reportCallIssue]
                torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False
            )
        expected = ref[0, len(prompt) :].tolist()
        assert [seq.tokens for seq in response.sequences] == [expected, expected]
        for seq in response.sequences:
            # Greedy reports the untempered logprob log_softmax(logits).
            assert max_logprob_error(model, prompt, seq, 1.0) <= ATOL


def test_top_k_one_is_greedy_and_logprobs_are_untruncated(
    model: nn.Module, sampler: Sampler
) -> None:
    greedy = sampler.sample(PROMPTS, 1, SamplingParams(max_tokens=8, temperature=0.0, stop=[]))
    top1 = sampler.sample(PROMPTS, 2, SamplingParams(max_tokens=8, seed=5, stop=[], top_k=1))
    for prompt, g, r in zip(PROMPTS, greedy, top1, strict=True):
        assert [s.tokens for s in r.sequences] == [g.sequences[0].tokens] * 2
        # The reported logprob ignores the truncation: log_softmax over the whole vocabulary.
        assert max_logprob_error(model, prompt, r.sequences[0], 1.0) <= ATOL
        assert all(lp < -1.0 for lp in r.sequences[0].logprobs or [])


def test_top_k_and_top_p_keep_sampled_tokens_inside_the_kept_set(
    model: nn.Module, sampler: Sampler
) -> None:
    for top_k, top_p in [(3, 1.0), (-1, 0.05), (10, 0.03)]:
        params = SamplingParams(max_tokens=6, seed=9, stop=[], top_k=top_k, top_p=top_p)
        for prompt, response in zip(PROMPTS, sampler.sample(PROMPTS, 3, params), strict=True):
            for seq in response.sequences:
                ids = torch.tensor([prompt + seq.tokens])
                with torch.no_grad():
                    logits_TV = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
                kept_TV = truncate_logits(logits_TV, top_k, top_p) > float("-inf")
                assert all(kept_TV[k, t] for k, t in enumerate(seq.tokens))


def test_truncate_logits_by_hand() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda k, p: (truncate_logits(logits, k, p) > float("-inf"))[0].tolist()  # noqa: E731
    assert kept(2, 1.0) == [True, True, False, False]
    assert kept(-1, 1.0) == [True] * 4
    # Nucleus: keep tokens while the mass before them is < top_p.
    # Mass before each token: 0, 0.5, 0.8, 0.95.
    assert kept(-1, 0.45) == [True, False, False, False]
    assert kept(-1, 0.75) == [True, True, False, False]
    assert kept(-1, 0.9) == [True, True, True, False]
    assert kept(3, 0.99) == [True, True, True, False]  # top-k first, then the nucleus


def test_inverse_cdf_draws_the_exact_distribution() -> None:
    # probabilities 0.1, 0.2, 0, 0.3, 0.4 (token 2 impossible). Uniforms on a midpoint grid of
    # N = 1000 land in each token's CDF interval exactly N * p times: 100, 200, 0, 300, 400.
    logits_V = torch.log(torch.tensor([0.1, 0.2, 0.0, 0.3, 0.4]))
    n = 1000
    u_N = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    tokens_N, logp_N = choose_tokens(logits_V.expand(n, -1), SamplingParams(), u_N)
    assert torch.bincount(tokens_N, minlength=5).tolist() == [100, 200, 0, 300, 400]
    assert torch.allclose(logp_N, logits_V[tokens_N])
    # The extremes of [0, 1) still pick tokens of positive probability.
    edges = torch.tensor([0.0, math.nextafter(1.0, 0.0)], dtype=torch.float64)
    tokens, _ = choose_tokens(logits_V[[2, 0, 1, 3, 4]].expand(2, -1), SamplingParams(), edges)
    assert tokens.tolist() == [1, 4]


@pytest.mark.parametrize(
    ("temperature", "top_p"), [(1e-300, 1.0), (5e-324, 1.0), (1.0, 5e-324), (1e-30, 1e-45)]
)
def test_extreme_temperature_and_top_p_give_their_limit(temperature: float, top_p: float) -> None:
    # Both limits are greedy: logits / 1e-300 overflows float32, and a top_p below float32's
    # least positive value rounds to 0 (both once sampled a token out of the vocabulary).
    logits_V = torch.log(torch.tensor([0.1, 0.2, 0.0, 0.3, 0.4]))
    u_N = torch.tensor([0.0, 0.5, math.nextafter(1.0, 0.0)], dtype=torch.float64)
    params = SamplingParams(temperature=temperature, top_p=top_p)
    tokens_N, logp_N = choose_tokens(logits_V.expand(3, -1), params, u_N)
    assert tokens_N.tolist() == [4, 4, 4]
    if temperature < 1e-38:  # the distribution itself is greedy: all its mass on token 4
        assert logp_N.tolist() == [0.0, 0.0, 0.0]
    else:
        assert torch.isfinite(logp_N).all()


XYZ = [ord("x"), ord("y"), ord("z")]


def test_stop_token_and_stop_string(model: PreTrainedModel, sampler: Sampler, tokenizer) -> None:
    with biased(model, XYZ):
        free = sampler.sample(PROMPTS, 1, SamplingParams(max_tokens=10, temperature=0.0, stop=[]))
        for prompt, response in zip(PROMPTS, free, strict=True):
            tokens = response.sequences[0].tokens
            assert set(tokens) <= set(XYZ) and response.sequences[0].stop_reason == "length"
            # Stop token: the 3rd greedy token; decoding ends at its first occurrence, included.
            cut = tokens.index(tokens[2]) + 1
            greedy = SamplingParams(max_tokens=10, temperature=0.0, stop=[tokens[2]])
            (stopped,) = sampler.sample([prompt], 1, greedy)[0].sequences
            assert (stopped.tokens, stopped.stop_reason) == (tokens[:cut], "stop")
            # Stop string: the text of tokens 2-3; it ends at the first prefix containing it.
            text = tokenizer.decode(tokens[1:3])
            cut = next(n for n in range(1, 11) if text in tokenizer.decode(tokens[:n]))
            by_string = SamplingParams(max_tokens=10, temperature=0.0, stop=[text, "never"])
            (stopped,) = sampler.sample([prompt], 1, by_string)[0].sequences
            assert (stopped.tokens, stopped.stop_reason) == (tokens[:cut], "stop")


def test_stop_string_while_sampling(sampler: Sampler, model: PreTrainedModel, tokenizer) -> None:
    with biased(model, XYZ):
        responses = sampler.sample(PROMPTS, 8, SamplingParams(max_tokens=10, seed=3, stop="zx"))
    reasons = set()
    for response in responses:
        for seq in response.sequences:
            text = tokenizer.decode(seq.tokens)
            reasons.add(seq.stop_reason)
            if seq.stop_reason == "stop":
                assert text.endswith("zx") and "zx" not in text[:-1]
            else:
                assert "zx" not in text and len(seq.tokens) == 10
    assert reasons == {"stop", "length"}


def test_eos(model: PreTrainedModel, sampler: Sampler, tokenizer) -> None:
    eos = tokenizer.eos_token_id
    with biased(model, [eos]):
        at_eos = sampler.sample(PROMPTS[:1], 2, SamplingParams(max_tokens=5, seed=0))
        assert [(s.tokens, s.stop_reason) for s in at_eos[0].sequences] == [([eos], "stop")] * 2
        (ignored,) = sampler.sample(PROMPTS[:1], 1, SamplingParams(max_tokens=5, stop=[]))
        assert (ignored.sequences[0].tokens, ignored.sequences[0].stop_reason) == (
            [eos] * 5,
            "length",
        )
        # Special tokens decode to their text, so a stop string can name one.
        (by_text,) = sampler.sample(PROMPTS[:1], 1, SamplingParams(max_tokens=5, stop="<|eos|>"))
        assert by_text.sequences[0].tokens == [eos]


def test_max_tokens_none_runs_to_the_last_position(sampler: Sampler) -> None:
    # The tiny model has 512 positions: a 505-token prompt leaves room for 7 tokens.
    long_prompt = [65 + i % 26 for i in range(505)]
    params = SamplingParams(max_tokens=None, seed=0, stop=[])
    short, long = sampler.sample([[1, 2], long_prompt], 1, SamplingParams(max_tokens=9, stop=[]))
    assert len(short.sequences[0].tokens) == 9 and len(long.sequences[0].tokens) == 7
    (seq,) = sampler.sample([long_prompt], 1, params)[0].sequences
    assert (len(seq.tokens), seq.stop_reason) == (7, "length")


def test_bad_inputs(sampler: Sampler) -> None:
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        sampler.sample(PROMPTS, 0, params)
    with pytest.raises(ValueError, match="first_index must be >= 0"):
        sampler.sample(PROMPTS, 1, params, first_index=-1)
    with pytest.raises(ValueError, match="prompts is empty"):
        sampler.sample([], 1, params)
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        sampler.sample([[1], []], 1, params)
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 260\): \[260\]"):
        sampler.sample([[1, 260]], 1, params)
    with pytest.raises(ValueError, match=r"outside the vocabulary .*\[-1\]"):
        sampler.compute_logprobs([-1, 3])
    with pytest.raises(ValueError, match="has 512 tokens; the model's max_positions=512"):
        sampler.sample([[1] * 512], 1, params)
    with pytest.raises(ValueError, match="has 513 tokens"):
        sampler.compute_logprobs([1] * 513)
    assert len(sampler.compute_logprobs([1] * 512)) == 512
    with pytest.raises(ValueError, match="must be a sequence of token ids"):
        sampler.sample([1, 2, 3], 1, params)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="prompt is empty"):
        sampler.compute_logprobs([])
