"""Clients of one base model share its weights (`models.shared_base`): one copy in memory,
and results bit-identical to clients that each loaded their own."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.engine.sft_datums import random_datums

from posttrain import AdamParams, ModelInput, SamplingParams
from posttrain.clients.create import create_training_client
from posttrain.clients.local import LocalTrainingClient
from posttrain.engine.executor import InProcessExecutor
from posttrain.models.load import load_hf_model
from posttrain.models.shared_base import SharedBases, shares_weights, sharing_copy

ADAM = AdamParams(learning_rate=1e-2)


def lora_client(
    model: Path, tmp_path: Path, seed: int, bases: SharedBases | None, rank: int = 4
) -> LocalTrainingClient:
    return create_training_client(
        model,
        lora_rank=rank,
        seed=seed,
        device="cpu",
        storage_dir=tmp_path / f"c{seed}-{rank}-{bases is not None}",
        shared_base=bases,
    )


def model_of(client: LocalTrainingClient) -> torch.nn.Module:
    executor = client.dispatch.executor
    assert isinstance(executor, InProcessExecutor)
    return executor.workers[0].model


def train(client: LocalTrainingClient, seed: int, steps: int = 3) -> list[float]:
    losses = []
    for step in range(steps):
        out = client.forward_backward(random_datums(seed + step), "cross_entropy").result()
        losses.append(out.metrics["loss:sum"])
        client.optim_step(ADAM).result()
    return losses


def test_sharing_copy_shares_tensors_not_parameters(tied_model_dir: Path) -> None:
    base = load_hf_model(tied_model_dir)
    copy = sharing_copy(base)
    pairs = list(zip(base.named_parameters(), copy.named_parameters(), strict=True))
    for (name, a), (name_b, b) in pairs:
        assert name == name_b
        assert a.data_ptr() == b.data_ptr(), name  # the same memory
        assert a is not b, name  # but requires_grad and .grad of its own
    # The tied pair is one Parameter in the copy as in the original.
    embedding, unembedding = copy.get_input_embeddings(), copy.get_output_embeddings()
    assert unembedding is not None and unembedding.weight is embedding.weight
    embedding.weight.requires_grad_(False)
    assert base.get_input_embeddings().weight.requires_grad
    assert shares_weights(copy, base)


def test_clients_of_one_base_hold_one_copy_of_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    bases = SharedBases()
    clients = [lora_client(tiny_model_dir, tmp_path, seed, bases) for seed in range(3)]
    models = [model_of(c) for c in clients]
    assert len(bases.loaded()) == 1
    assert shares_weights(models[1], models[0]) and shares_weights(models[2], models[0])
    # Distinct memory across the three: the base once, plus three adapters.
    storages = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
        for m in models
        for p in m.parameters()
    }
    base_bytes = sum(p.numel() * p.element_size() for p in bases.loaded()[0].parameters())
    adapter_bytes = sum(
        p.numel() * p.element_size() for p in models[0].parameters() if p.requires_grad
    )
    assert sum(storages.values()) == base_bytes + 3 * adapter_bytes
    # The tokenizer too: at a 150k-token vocabulary it outweighs a small adapter.
    assert len({id(c.get_tokenizer()) for c in clients}) == 1
    for client in clients:
        client.close()


def test_shared_clients_train_as_if_each_had_its_own_model(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Two clients interleave steps on one base; each one's losses, weights and samples are
    bit-identical to a client that loaded the base alone and never saw the other."""
    bases = SharedBases()
    a, b = (lora_client(tiny_model_dir, tmp_path, seed, bases) for seed in (1, 2))
    a_alone = lora_client(tiny_model_dir, tmp_path, 1, None)
    frozen = {n: p.clone() for n, p in bases.loaded()[0].named_parameters()}
    a_losses, b_losses = [], []
    for step in range(3):
        a_losses += train(a, 10 + step, steps=1)
        b_losses += train(b, 50 + step, steps=1)
    assert a_losses == train(a_alone, 10, steps=3)
    assert b_losses != a_losses
    state_a = {n: p for n, p in model_of(a).named_parameters() if p.requires_grad}
    state_alone = {n: p for n, p in model_of(a_alone).named_parameters() if p.requires_grad}
    assert state_a.keys() == state_alone.keys()
    assert all(torch.equal(state_a[n], state_alone[n]) for n in state_a)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompt = ModelInput.from_ints([3, 17, 42, 99])
    assert a.sample(prompt, 1, params).result() == a_alone.sample(prompt, 1, params).result()
    # Training wrote the adapters only: the shared base is bit-identical to before.
    for name, param in bases.loaded()[0].named_parameters():
        assert torch.equal(param, frozen[name]), name
    for client in (a, b, a_alone):
        client.close()


def test_a_reference_model_shares_the_base(tiny_model_dir: Path, tmp_path: Path) -> None:
    bases = SharedBases()
    policy = lora_client(tiny_model_dir, tmp_path, 0, bases)
    reference = create_training_client(
        tiny_model_dir,
        lora_rank=None,
        head="reference",
        device="cpu",
        storage_dir=tmp_path / "ref",
        shared_base=bases,
    )
    assert shares_weights(model_of(policy), model_of(reference))
    prompt = ModelInput.from_ints([5, 6, 7])
    base_alone = create_training_client(
        tiny_model_dir, lora_rank=None, head="reference", device="cpu", storage_dir=tmp_path / "b"
    )
    assert (
        reference.compute_logprobs(prompt).result() == base_alone.compute_logprobs(prompt).result()
    )


@pytest.mark.parametrize("kind", ["full", "value"])
def test_what_trains_the_base_may_not_share_it(
    tiny_model_dir: Path, tmp_path: Path, kind: str
) -> None:
    with pytest.raises(ValueError, match="shared_base is for LoRA policies"):
        create_training_client(
            tiny_model_dir,
            lora_rank=None if kind == "full" else 4,
            head="policy" if kind == "full" else "value",
            device="cpu",
            storage_dir=tmp_path,
            shared_base=SharedBases(),
        )
