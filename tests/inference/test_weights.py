"""LoRA merging for engines with their own weights: hand values, a naive reference, PEFT."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.inference.weights import WeightExporter, merge_trainable
from posttrain.models.load import LoraSettings, apply_lora, load_hf_model, ties_embeddings


def test_merge_by_hand():
    # W0 = [[1, 0], [0, 1]], B = [[1], [2]], A = [[3, 4]], scale 0.5:
    # B @ A = [[3, 4], [6, 8]], so W = W0 + 0.5 * B @ A = [[2.5, 2], [3, 5]].
    base = {"model.q.weight": torch.eye(2), "model.k.weight": torch.ones(2, 2)}
    trainable = {
        "base_model.model.model.q.lora_A.default.weight": torch.tensor([[3.0, 4.0]]),
        "base_model.model.model.q.lora_B.default.weight": torch.tensor([[1.0], [2.0]]),
    }
    merged = merge_trainable(base, trainable, lora_scale=0.5)
    assert torch.equal(merged["model.q.weight"], torch.tensor([[2.5, 2.0], [3.0, 5.0]]))
    assert torch.equal(merged["model.k.weight"], torch.ones(2, 2))  # untouched
    assert "base_model.model.model.q.lora_A.default.weight" not in merged


def test_an_embedding_adapter_merges_transposed():
    # A tied model's adapter on the shared [vocab, hidden] table: A [rank, vocab], B [hidden,
    # rank], W = W0 + s (B A)^T. With A = [[1, 2, 3]], B = [[1], [0]], s = 2: (B A)^T =
    # [[1, 0], [2, 0], [3, 0]], so W = [[2, 0], [4, 0], [6, 0]] from W0 = 0, and lm_head too.
    base = {"model.embed_tokens.weight": torch.zeros(3, 2)}
    trainable = {
        "base_model.model.model.embed_tokens.lora_embedding_A.default": torch.tensor(
            [[1.0, 2.0, 3.0]]
        ),
        "base_model.model.model.embed_tokens.lora_embedding_B.default": torch.tensor(
            [[1.0], [0.0]]
        ),
    }
    merged = merge_trainable(base, trainable, lora_scale=2.0)
    want = torch.tensor([[2.0, 0.0], [4.0, 0.0], [6.0, 0.0]])
    assert torch.equal(merged["model.embed_tokens.weight"], want)
    assert sorted(merged) == ["model.embed_tokens.weight"]


def test_full_fine_tuning_replaces_and_a_tied_matrix_stays_one():
    base = {"model.embed_tokens.weight": torch.zeros(3, 2), "model.norm.weight": torch.ones(2)}
    trained = {"model.embed_tokens.weight": torch.full((3, 2), 7.0)}
    merged = merge_trainable(base, trained, lora_scale=None)
    assert torch.equal(merged["model.embed_tokens.weight"], torch.full((3, 2), 7.0))
    # A tied base model has no lm_head.weight, nor does what is written: still tied.
    assert "lm_head.weight" not in merged


def test_lora_without_scale_is_an_error():
    trainable = {"base_model.model.x.lora_A.default.weight": torch.ones(1, 2)}
    with pytest.raises(ValueError, match="lora_scale"):
        merge_trainable({"x.weight": torch.ones(2, 2)}, trainable, lora_scale=None)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_merged_model_computes_what_peft_does(
    tied: bool, tiny_model_dir: Path, tied_model_dir: Path, tmp_path: Path
):
    """The exported weights in a plain model give PEFT's logits (every default LoRA layer,
    lm_head included, with B made non-zero; on a tied model the shared matrix's adapter, whose
    embedding A starts at zero)."""
    base = tied_model_dir if tied else tiny_model_dir
    settings = LoraSettings(rank=4, alpha=8.0, train_unembed=True if tied else None)
    peft_model = apply_lora(load_hf_model(base), settings, seed=0)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name or "lora_embedding_A" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    trainable = {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    assert any("lora_embedding_A" in n for n in trainable) == tied
    exporter = WeightExporter(base, tmp_path / "w", lora=LoraSettings.of(4, 8.0))
    snapshot = exporter.export(trainable, version=3)
    assert snapshot.path.name == "v3"
    plain = load_hf_model(snapshot.path)
    assert ties_embeddings(plain) == tied  # a tied model stays one (its tie once failed to save)
    tokens = torch.tensor([[5, 17, 99, 3, 42, 7]])
    with torch.no_grad():
        want = peft_model(tokens).logits
        got = plain(tokens).logits
    # fp32, the same products summed in another order: a few ulps of logits up to ~1.5
    # (measured max 4.2e-7); a wrong scale or a missed layer moves them by ~1e-2.
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    assert not torch.allclose(got, load_hf_model(base)(tokens).logits, atol=1e-3)


def test_exporter_keeps_the_newest_versions(tiny_model_dir: Path, tmp_path: Path):
    exporter = WeightExporter(tiny_model_dir, tmp_path / "w", lora=None)
    weights = load_file(str(next(tiny_model_dir.glob("*.safetensors"))))
    for version in range(4):
        exporter.export(copy.copy(weights), version)
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["v2", "v3"]
    exporter.close()
    assert not (tmp_path / "w").exists()


def test_exporter_needs_a_model_directory(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        WeightExporter("org/hub-model", tmp_path / "w", lora=None)
    with pytest.raises(FileNotFoundError, match="nothing' does not exist"):
        WeightExporter(tmp_path / "nothing", tmp_path / "w", lora=None)


def test_a_rank_above_32_merges_at_the_trainer_s_default_alpha(
    tiny_model_dir: Path, tmp_path: Path
):
    """alpha None is `LoraSettings.default_alpha(rank)`: 32 up to rank 32, else the rank, so
    rank 64 merges at scale 1 (the engines once took 32 for every rank: scale 0.5 here)."""
    from posttrain.inference.updates import UpdateExporter

    for rank, scale in ((64, 1.0), (8, 4.0)):
        exporter = WeightExporter(tiny_model_dir, tmp_path / "w", lora=LoraSettings.of(rank))
        assert exporter.lora_scale == scale
    update = UpdateExporter(
        tmp_path / "u",
        base_model="x",
        lora=LoraSettings.of(64),
        route="adapter",
        dtype="float32",
    )
    assert update.lora_scale == 1.0
