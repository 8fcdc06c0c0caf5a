"""Snapshot sampling clients of an in-process training client: weights copied in memory (no
files), snapshot semantics, replicas reused once a snapshot client is closed or dropped, and
close() letting go of the model."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from test_local_client import sft_datums

from posttrain.clients.create import create_training_client
from posttrain.clients.local_sampling import LocalSamplingClient, load_replica
from posttrain.types import AdamParams, ModelInput, SampleResponse, SamplingParams

PARAMS = SamplingParams(max_tokens=8, seed=3)


def replica_of(sampler: LocalSamplingClient) -> torch.nn.Module:
    held = sampler._sampler
    assert held is not None
    return held.model


def assert_holds(
    sampler: LocalSamplingClient,
    weights: dict[str, torch.Tensor],
    expected: SampleResponse,
    prompt: ModelInput,
) -> None:
    """`sampler` holds exactly `weights` (every parameter and buffer, frozen ones included) and
    samples what the training model sampled on them."""
    held = replica_of(sampler).state_dict()
    assert held.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(held[name], tensor), name
    out = sampler.sample(prompt, 2, PARAMS).result()
    assert [s.tokens for s in out.sequences] == [s.tokens for s in expected.sequences]
    # Equal weights in differently aligned storage: 1 float32 ulp at most was measured (see
    # test_sampling_clients_keep_the_published_weights); 1e-6 relative is a few ulps.
    torch.testing.assert_close(
        [s.logprobs for s in out.sequences],
        [s.logprobs for s in expected.sequences],
        rtol=1e-6,
        atol=0.0,
    )


@pytest.mark.parametrize("lora_rank", [None, 4])
def test_snapshots_copy_in_memory_and_reuse_released_replicas(tiny_model_dir, tmp_path, lora_rank):
    client = create_training_client(tiny_model_dir, lora_rank=lora_rank, storage_dir=tmp_path)
    trained = client.dispatch.executor.workers[0].model  # pyright: ignore[reportAttributeAccessIssue]
    datums = sft_datums(client.get_tokenizer(), ["the cat sat", "on the mat"])
    prompt = ModelInput.from_ints(datums[0].model_input.to_ints()[:4])

    def step() -> tuple[dict[str, torch.Tensor], SampleResponse]:
        """One training step, then the trained weights and what they sample."""
        client.forward_backward(datums, "cross_entropy").result()
        client.optim_step(AdamParams(learning_rate=2e-2)).result()
        weights = {n: t.detach().clone() for n, t in trained.state_dict().items()}
        return weights, client.sample(prompt, 2, PARAMS).result()

    at = [step()]
    first = client.save_weights_and_get_sampling_client().result()
    assert not (tmp_path / "sampler_weights").exists()  # nothing written, not even briefly
    at.append(step())
    second = client.save_weights_and_get_sampling_client().result()
    assert replica_of(second) is not replica_of(first)  # the first is still in use
    assert_holds(first, *at[0], prompt)  # as of its snapshot, after more training
    reused = replica_of(first)
    first.close()
    with pytest.raises(RuntimeError, match="closed"):
        first.sample(prompt, 1, PARAMS)
    at.append(step())
    third = client.save_weights_and_get_sampling_client().result()
    assert replica_of(third) is reused  # the closed client's replica, weights copied in place
    assert_holds(third, *at[2], prompt)
    assert_holds(second, *at[1], prompt)  # untouched by the copy into the other replica
    reused = replica_of(third)
    del third  # dropped without close(), as a loop that takes a snapshot per step does
    gc.collect()
    at.append(step())
    fourth = client.save_weights_and_get_sampling_client().result()
    assert replica_of(fourth) is reused
    del reused
    assert_holds(fourth, *at[3], prompt)
    # close() lets go: once the training client is closed too, nothing holds the replicas.
    gone = [weakref.ref(replica_of(s)) for s in (second, fourth)]
    second.close()
    fourth.close()
    client.close()
    gc.collect()
    assert all(ref() is None for ref in gone)


def test_a_loaded_sampling_client_lets_go_of_its_model_on_close(tiny_model_dir, tmp_path):
    client = create_training_client(tiny_model_dir, lora_rank=4, storage_dir=tmp_path)
    path = client.save_weights_for_sampler("published").result().path
    named = client.create_sampling_client(path).result()
    assert named.model_path == path
    gone = weakref.ref(replica_of(named))
    named.close()
    client.close()
    gc.collect()
    assert gone() is None


def test_a_published_snapshot_loads_into_an_idle_replica(tiny_model_dir, tmp_path):
    """The path of workers in other processes (Ray): the replica reads the published files,
    into a fresh replica from the factory or in place into an idle one."""
    client = create_training_client(tiny_model_dir, lora_rank=4, storage_dir=tmp_path)
    assert client.worker_factory is not None
    trained = client.dispatch.executor.workers[0].model  # pyright: ignore[reportAttributeAccessIssue]
    datums = sft_datums(client.get_tokenizer(), ["the cat sat"])
    published = []
    for name in ("one", "two"):
        client.forward_backward(datums, "cross_entropy").result()
        client.optim_step(AdamParams(learning_rate=2e-2)).result()
        weights = {n: t.detach().clone() for n, t in trained.state_dict().items()}
        published.append((client.save_weights_for_sampler(name).result().path, weights))
    replica = load_replica(client.worker_factory, published[0][0])
    reloaded = load_replica(client.worker_factory, published[1][0], replica)
    assert reloaded is replica
    held = reloaded.model.state_dict()
    assert held.keys() == published[1][1].keys()
    for name, tensor in published[1][1].items():  # the safetensors round trip is exact
        assert torch.equal(held[name], tensor), name
    client.close()
