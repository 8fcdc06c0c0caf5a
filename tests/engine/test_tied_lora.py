"""LoRA on a model whose unembedding is its input embedding (tied, as SmolLM2 and Qwen2.5-0.5B
publish it): adapters that hold no base weight, that plain PEFT loads and merges, and with
`train_unembed=True` one adapter on the shared matrix whose gradient sums both of its uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from tests.engine.sft_datums import random_datums
from torch.func import functional_call

from posttrain import AdamParams, Datum
from posttrain.clients.create import create_training_client
from posttrain.engine.logprob_pass import target_logprobs
from posttrain.models.load import LoraSettings, apply_lora, load_hf_model, ties_embeddings

RANK, ALPHA = 4, 8.0


def trained(base: Path, tmp_path: Path, train_unembed: bool | None = None):
    """A LoRA client after 3 AdamW steps at lr 1e-2 (a step moves the logprobs by ~1e-2, far
    above fp32 rounding), and its saved adapter."""
    client = create_training_client(
        base,
        lora_rank=RANK,
        lora_alpha=ALPHA,
        train_unembed=train_unembed,
        seed=0,
        storage_dir=tmp_path,
    )
    for step in range(3):
        client.forward_backward(random_datums(step), "cross_entropy").result()
        client.optim_step(AdamParams(learning_rate=1e-2)).result()
    return client, Path(client.save_weights_for_sampler("s").result().path)


def logprobs_of(client, data: list[Datum]) -> torch.Tensor:
    out = client.forward(data, "cross_entropy").result().loss_fn_outputs
    return torch.cat([torch.as_tensor(o["logprobs"]).float() for o in out])


def logprobs_of_model(model: torch.nn.Module, data: list[Datum]) -> torch.Tensor:
    rows = []
    with torch.no_grad():
        for datum in data:
            ids = torch.tensor([datum.model_input.to_ints()])
            logits = model(input_ids=ids).logits[0].float()
            targets = torch.as_tensor(datum.loss_fn_inputs["target_tokens"])
            rows.append(logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0])
    return torch.cat(rows)


def test_the_fixture_is_tied(tied_model_dir: Path, tiny_model_dir: Path) -> None:
    assert ties_embeddings(load_hf_model(tied_model_dir))
    assert not ties_embeddings(load_hf_model(tiny_model_dir))


@pytest.mark.parametrize("tied", [True, False])
def test_default_adapter_holds_no_base_weight_and_merges_with_peft(
    tied: bool, tied_model_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The default: a tied model's shared matrix is left alone, an untied lm_head is adapted
    (as before). Either way PEFT's own load, and its merge_and_unload, give the trained model."""
    base = tied_model_dir if tied else tiny_model_dir
    client, path = trained(base, tmp_path)
    saved = load_file(path / "adapter_model.safetensors")
    assert all("lora_" in key for key in saved), sorted(saved)  # adapter factors only
    assert any("lm_head" in key for key in saved) == (not tied)
    assert not any("embed_tokens" in key for key in saved)
    # Hand count of the file: rank 4 on q/k/v/o (64x64, kv 64x32) and gate/up/down (64x128),
    # 2 layers; an untied lm_head adds A [4, 64] + B [260, 4].
    lora_numbers = sum(t.numel() for t in saved.values())
    per_layer = 4 * ((64 + 64) * 2 + (64 + 32) * 2 + (64 + 128) * 3)
    assert lora_numbers == 2 * per_layer + (0 if tied else 4 * (64 + 260))

    data = random_datums(7)
    want = logprobs_of(client, data)
    assert (want - logprobs_of_model(load_hf_model(base), data)).abs().max() > 1e-3
    merged = PeftModel.from_pretrained(load_hf_model(base), path).merge_and_unload()
    # fp32: W + s B A summed once into W, against x W^T + s (x A^T) B^T per token; the same
    # products in another order, measured <= 9.5e-7 on logprobs of about -5.8. A wrong or
    # doubled delta is off by ~1e-2 (PEFT's merge of a tied lm_head adapter was 3e-3 after one
    # step at lr 1e-4).
    torch.testing.assert_close(logprobs_of_model(merged, data), want, rtol=0, atol=5e-6)
    client.close()


def test_train_unembed_adapts_the_shared_matrix_once(tied_model_dir: Path, tmp_path: Path) -> None:
    """train_unembed=True on a tied model: one LoRA on the shared matrix (PEFT's
    `ensure_weight_tying` layout), trained as one Parameter per factor. PEFT loads the adapter
    as is; merging the embedding's delta alone gives the model a tied matrix of W + s (B A)^T."""
    client, path = trained(tied_model_dir, tmp_path, train_unembed=True)
    worker = client.dispatch.executor.workers[0]  # pyright: ignore[reportAttributeAccessIssue]
    tied_names = [n for n in worker.trainable_parameters() if "embed" in n or "lm_head" in n]
    assert sorted(tied_names) == [
        "base_model.model.model.embed_tokens.lora_embedding_A.default",
        "base_model.model.model.embed_tokens.lora_embedding_B.default",
    ]
    saved = load_file(path / "adapter_model.safetensors")
    assert all("lora_" in key for key in saved)
    # What PEFT writes for a tied adapter: the embedding's factors and their transposes.
    embedding_A = saved["base_model.model.model.embed_tokens.lora_embedding_A"]
    assert torch.equal(saved["base_model.model.lm_head.lora_B.weight"], embedding_A.t())

    data = random_datums(7)
    want = logprobs_of(client, data)
    with pytest.warns(UserWarning, match="tie_word_embeddings"):  # PEFT's own, on its merge
        peft = PeftModel.from_pretrained(load_hf_model(tied_model_dir), path)
        torch.testing.assert_close(logprobs_of_model(peft, data), want, rtol=0, atol=5e-6)
        # docs/backends.md's merge: PEFT 0.21 would add the delta once for the embedding and
        # again for lm_head, which is the same matrix, so lm_head's tied adapter goes first.
        lm: Any = peft.get_base_model()
        lm.lm_head = lm.lm_head.get_base_layer()
        merged = peft.merge_and_unload()
    assert ties_embeddings(merged)
    torch.testing.assert_close(logprobs_of_model(merged, data), want, rtol=0, atol=5e-6)
    client.close()


def test_the_shared_matrix_gets_the_gradient_of_both_uses(tied_model_dir: Path) -> None:
    """The factors' gradient through posttrain's chunked logprob pass equals a naive model whose
    one matrix W + s (B A)^T feeds both the embedding lookup and the output projection."""
    settings = LoraSettings(
        rank=RANK, alpha=ALPHA, train_attn=False, train_mlp=False, train_unembed=True
    )
    model = apply_lora(load_hf_model(tied_model_dir), settings, seed=0)
    lm: Any = model.get_base_model()
    embedding = lm.get_input_embeddings()
    with torch.no_grad():  # A starts at zero: give the term a value
        embedding.lora_embedding_A["default"].normal_(
            0, 0.1, generator=torch.Generator().manual_seed(1)
        )
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(2))
    logp, _ = target_logprobs(
        model, ids[:, :-1], torch.ones_like(ids[:, :-1]), ids[:, 1:], chunk_size=8
    )
    logp.sum().backward()

    plain = load_hf_model(tied_model_dir)
    a = embedding.lora_embedding_A["default"].detach().clone().requires_grad_()
    b = embedding.lora_embedding_B["default"].detach().clone().requires_grad_()
    w = plain.model.embed_tokens.weight + (ALPHA / RANK) * (b @ a).t()
    logits = functional_call(plain, {"model.embed_tokens.weight": w}, (ids[:, :-1],)).logits
    ref = logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    ref.sum().backward()
    torch.testing.assert_close(logp, ref, rtol=0, atol=1e-5)
    for mine, theirs in (
        (embedding.lora_embedding_A["default"], a),
        (embedding.lora_embedding_B["default"], b),
    ):
        assert mine.grad is not None and theirs.grad is not None
        error = (mine.grad - theirs.grad).abs().max() / theirs.grad.abs().max()
        assert error <= 1e-5, float(error)


def test_a_tied_model_with_nothing_else_to_adapt_is_an_error(tied_model_dir: Path) -> None:
    settings = LoraSettings(rank=RANK, train_attn=False, train_mlp=False)
    with pytest.raises(ValueError, match="train_unembed=True to adapt the shared"):
        apply_lora(load_hf_model(tied_model_dir), settings)


def test_full_fine_tuning_trains_and_restores_one_tied_matrix(
    tied_model_dir: Path, tmp_path: Path
) -> None:
    """Full fine-tuning of a tied model trains the one matrix (a single Parameter under the
    embedding's name) and a checkpoint, which holds it once, restores it tied."""
    client = create_training_client(
        tied_model_dir, seed=0, storage_dir=tmp_path / "a", lora_rank=None
    )
    worker = client.dispatch.executor.workers[0]  # pyright: ignore[reportAttributeAccessIssue]
    names = list(worker.trainable_parameters())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    client.forward_backward(random_datums(0), "cross_entropy").result()
    client.optim_step(AdamParams(learning_rate=1e-2)).result()
    path = client.save_state("s").result().path
    data = random_datums(7)
    want = logprobs_of(client, data)
    restored = create_training_client(
        tied_model_dir, seed=1, storage_dir=tmp_path / "b", lora_rank=None
    )
    restored.load_state(path).result()
    lm: Any = restored.dispatch.executor.workers[0].model  # pyright: ignore[reportAttributeAccessIssue]
    assert lm.lm_head.weight is lm.model.embed_tokens.weight
    assert torch.equal(logprobs_of(restored, data), want)
    client.close()
    restored.close()
