"""The published architectures `make_tiny_model` builds: Qwen2.5-0.5B, Llama-3.2-1B, Qwen3-0.6B
and Qwen3.5-0.8B's text model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain import Datum, ModelInput
from posttrain.clients.create import create_training_client
from posttrain.models.tiny import build_config, build_tokenizer, make_tiny_model
from posttrain.types import AdamParams

# Fields of the published config.json files (Qwen/Qwen2.5-0.5B-Instruct, meta-llama/Llama-3.2-1B,
# Qwen/Qwen3-0.6B, Qwen/Qwen3.5-0.8B's text_config).
PUBLISHED = {
    "qwen2.5-0.5b": {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
    "llama3.2-1b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 8192,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    },
    "qwen3-0.6b": {
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 3072,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
    },
    "qwen3.5-0.8b": {
        "model_type": "qwen3_5_text",
        "vocab_size": 248320,
        "hidden_size": 1024,
        "num_hidden_layers": 24,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "tie_word_embeddings": True,
    },
}
ROPE = {
    "qwen2.5-0.5b": {"rope_type": "default", "rope_theta": 1000000.0},
    "llama3.2-1b": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "qwen3-0.6b": {"rope_type": "default", "rope_theta": 1000000.0},
    "qwen3.5-0.8b": {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
    },
}
# The parameter counts (tied embeddings counted once): 494M, 1.24B, 596M (Qwen3-0.6B's card:
# 0.6B, 0.44B without embeddings) and 752M (Qwen3.5-0.8B without its vision encoder).
PARAMETERS = {
    "qwen2.5-0.5b": 494_032_768,
    "llama3.2-1b": 1_235_814_400,
    "qwen3-0.6b": 596_049_920,
    "qwen3.5-0.8b": 752_393_024,
}


@pytest.mark.parametrize("size", sorted(PUBLISHED))
def test_config_is_the_published_one(size: str) -> None:
    config = build_config(size=size)  # pyright: ignore[reportArgumentType]
    assert {key: getattr(config, key) for key in PUBLISHED[size]} == PUBLISHED[size]
    assert config.rope_parameters == ROPE[size]
    # On the meta device: shapes only, no 2-5 GB of weights.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == PARAMETERS[size]


def test_qwen3_5_size_keeps_the_published_layer_pattern() -> None:
    config = build_config(size="qwen3.5-0.8b")
    assert config.layer_types.count("full_attention") == 6  # every fourth of 24
    assert config.layer_types[3::4] == ["full_attention"] * 6


def test_a_real_size_has_its_own_arch() -> None:
    assert build_config("llama", "llama3.2-1b").model_type == "llama"
    with pytest.raises(ValueError, match="is a qwen2 architecture"):
        build_config("llama", "qwen2.5-0.5b")


@pytest.mark.parametrize("vocab_size", [151936, 128256])
def test_tokenizer_fills_the_vocabulary(vocab_size: int) -> None:
    tokenizer = build_tokenizer(vocab_size)
    assert len(tokenizer) == vocab_size
    assert tokenizer.convert_ids_to_tokens([256, 257, 258, 259]) == [
        "<|bos|>",
        "<|eos|>",
        "<|pad|>",
        "<|im_start|>",
    ]
    text = "the quick brown fox, héllo 123 ~"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    # Merges make common text shorter than its bytes, and the last ids are reachable tokens.
    assert len(ids) < len(text.encode()) / 2
    last = tokenizer.convert_ids_to_tokens(vocab_size - 1)
    assert tokenizer.convert_tokens_to_ids(last) == vocab_size - 1
    assert tokenizer(tokenizer.decode([vocab_size - 1]), add_special_tokens=False)["input_ids"] == [
        vocab_size - 1
    ]


@pytest.mark.slow
def test_qwen_0_5b_builds_saves_loads_and_trains_a_lora_step(tmp_path: Path) -> None:
    """Build, save (bf16, 1 GB), load, one LoRA step: 17 s at 1 thread on a quiet machine (54 s
    at load average 10), about 4 GB of RSS; within CI's budget, so it runs there."""
    path = make_tiny_model(tmp_path / "qwen", size="qwen2.5-0.5b")
    tokenizer = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "reverse abc"}, {"role": "assistant", "content": "cba"}]
    ids = tokenizer.apply_chat_template(messages, tokenize=False)
    ids = tokenizer(ids, add_special_tokens=False)["input_ids"]
    datum = Datum(
        ModelInput.from_ints(ids[:-1]),
        {"target_tokens": torch.tensor(ids[1:]), "weights": torch.ones(len(ids) - 1)},
    )
    client = create_training_client(path, lora_rank=16, dtype="float32", device="cpu")
    before = client.forward_backward([datum], "cross_entropy").result()
    # The loaded checkpoint is the architecture transformers knows: its own forward agrees
    # with the worker's chunked logprobs to fp32 rounding over 24 layers.
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = reference(input_ids=torch.tensor([ids[:-1]])).logits[0]
    expected = logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(before.loss_fn_outputs[0]["logprobs"], expected, rtol=0, atol=1e-4)
    # A random model is near uniform over the real vocabulary: log p ~ -log(151936) = -11.9.
    assert abs(float(expected.mean()) + math.log(151936)) < 1.5
    client.optim_step(AdamParams(learning_rate=1e-3)).result()
    after = client.forward([datum], "cross_entropy").result()
    assert after.metrics["loss:sum"] < before.metrics["loss:sum"] - 1.0
    client.close()


def test_a_job_names_a_real_size_with_its_arch() -> None:
    from posttrain.jobs.tables import parse_tiny_spec

    assert parse_tiny_spec("tiny:qwen2:qwen2.5-0.5b") == ("qwen2", "qwen2.5-0.5b", None)
    with pytest.raises(ValueError, match=r"size 'qwen2\.5-0\.5b' is a qwen2 architecture"):
        parse_tiny_spec("tiny:llama:qwen2.5-0.5b")
