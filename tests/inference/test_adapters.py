"""The adapter engines load: PEFT reads back every factor exactly; lm_head stays apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel

from posttrain.clients.create import create_training_client
from posttrain.inference.adapters import split_adapter, write_adapter
from posttrain.models.load import load_hf_model
from posttrain.models.tiny import tiny_model_path


def _trained(train_unembed: bool) -> tuple[Path, dict[str, torch.Tensor]]:
    base = tiny_model_path(arch="qwen2")
    client = create_training_client(
        str(base), lora_rank=4, lora_alpha=8, train_unembed=train_unembed
    )
    weights = client.trainable_weights().result()
    generator = torch.Generator().manual_seed(0)
    return base, {k: 0.1 * torch.randn(v.shape, generator=generator) for k, v in weights.items()}


def test_peft_loads_the_written_adapter_exactly(tmp_path: Path):
    base, weights = _trained(train_unembed=False)
    split = split_adapter(weights)
    assert not split.other
    assert split.target_modules == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    written = write_adapter(split, tmp_path, rank=4, alpha=8, base_model=str(base))
    assert written == split.adapter_bytes == sum(v.numel() * 4 for v in weights.values())
    model = PeftModel.from_pretrained(
        load_hf_model(str(base), dtype="float32", device="cpu"), str(tmp_path)
    )
    state = model.state_dict()
    for name, tensor in weights.items():
        assert torch.equal(state[name], tensor), name


def test_the_unembedding_adapter_is_kept_apart(tmp_path: Path):
    _, weights = _trained(train_unembed=True)
    split = split_adapter(weights)
    assert sorted(split.other) == [
        "base_model.model.lm_head.lora_A.default.weight",
        "base_model.model.lm_head.lora_B.default.weight",
    ]
    assert "lm_head" not in split.target_modules
    assert len(split.adapter) + 2 == len(weights)
    assert "lm_head" in split.adapted and split.whole == []


def test_a_tied_unembedding_adapter_is_the_embeddings():
    """On a tied model the unembedding's adapter is PEFT's embedding adapter, whose factors
    are named `lora_embedding_A`/`_B` (no `.weight`): a LoRA factor, on embed_tokens."""
    split = split_adapter(
        {
            "base_model.model.model.embed_tokens.lora_embedding_A.default": torch.ones(2, 4),
            "base_model.model.model.embed_tokens.lora_embedding_B.default": torch.ones(4, 2),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight": torch.ones(2),
        }
    )
    assert split.target_modules == ["q_proj"] and split.adapted == ["embed_tokens", "q_proj"]
    assert split.whole == []


def test_full_fine_tuning_has_no_adapter(tmp_path: Path):
    split = split_adapter({"model.norm.weight": torch.ones(2)})
    assert split.adapter == {} and list(split.other) == ["model.norm.weight"]
    assert split.adapted == [] and split.whole == ["model.norm.weight"]
    with pytest.raises(ValueError, match="no LoRA factor"):
        write_adapter(split, tmp_path, rank=1, alpha=1, base_model="x")
