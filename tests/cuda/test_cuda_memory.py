"""Offloading returns GPU memory: after `offload()` the allocator holds what it held before the
client existed (plus nothing the client owns), and the next call brings everything back."""

from __future__ import annotations

import gc

import pytest
import torch
from cuda_helpers import report, sft_datums

from posttrain.clients.create import create_training_client
from posttrain.types import AdamParams, ModelInput, SamplingParams


def cuda_tensors() -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The live CUDA tensors' shapes and dtypes: what an assertion names when memory stays."""
    found = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda]
    return [(tuple(t.shape), t.dtype) for t in found][:20]


def settled_allocation() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


@pytest.mark.parametrize("rank", [8, None], ids=["lora", "full"])
def test_offload_and_reload_return_memory_to_its_baseline(tiny_model_dir, tmp_path, rank):
    # cuBLAS keeps a workspace per stream through torch's allocator once a matmul has run:
    # take it before the baseline, so the baseline is the device with nothing of ours on it.
    warm = torch.randn(64, 64, device="cuda", requires_grad=True)
    (warm @ warm).sum().backward()
    del warm
    baseline = settled_allocation()
    client = create_training_client(
        tiny_model_dir, lora_rank=rank, device="cuda", storage_dir=tmp_path
    )
    datums = sft_datums()
    client.forward_backward(datums, "cross_entropy").result()
    client.optim_step(AdamParams(learning_rate=1e-3)).result()
    client.forward_backward(datums, "cross_entropy").result()  # gradients held too
    torch.cuda.synchronize()
    training = torch.cuda.memory_allocated()
    client.offload().result()
    offloaded = settled_allocation()
    report(
        f"gpu memory {'lora' if rank else 'full'}",
        baseline_bytes=baseline,
        training_bytes=training,
        offloaded_bytes=offloaded,
    )
    assert training > baseline
    # Nothing of the client's stays on the device: weights, gradients and moments all left.
    assert offloaded == baseline, (baseline, training, offloaded, cuda_tensors())

    # The next call reloads what it needs and trains on: the parked gradients included.
    client.optim_step(AdamParams(learning_rate=1e-3)).result()
    client.sample(ModelInput.from_ints([5, 6, 7]), 2, SamplingParams(max_tokens=4, seed=0)).result()
    client.forward_backward(datums, "cross_entropy").result()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() > baseline
    client.close()
    del client
    closed = settled_allocation()
    report(f"gpu memory after close {'lora' if rank else 'full'}", closed_bytes=closed)
    assert closed == baseline, (baseline, closed, cuda_tensors())  # close frees it all


def test_a_small_model_keeps_its_training_state_on_the_gpu_while_sampling(tiny_model_dir, tmp_path):
    """With "auto" parking the tiny model's gradients and moments are far below a quarter of any
    GPU, so an RL cycle (sample, train, step) moves nothing over PCIe; asked to, it parks."""
    made = {
        park: create_training_client(
            tiny_model_dir,
            lora_rank=None,
            device="cuda",
            storage_dir=tmp_path / str(park),
            park_for_sampling=park,
        )
        for park in (None, True)
    }
    datums = sft_datums()
    prompt, params = ModelInput.from_ints([5, 6, 7]), SamplingParams(max_tokens=4, seed=0)
    for client in made.values():
        for _ in range(2):
            client.sample(prompt, 2, params).result()
            client.forward_backward(datums, "cross_entropy").result()
            client.optim_step(AdamParams(learning_rate=1e-3)).result()
    assert not made[None].dispatch.park_for_sampling
    assert made[None].dispatch.moves == []
    assert ("offload", "optimizer") in made[True].dispatch.moves
    for client in made.values():
        client.close()
