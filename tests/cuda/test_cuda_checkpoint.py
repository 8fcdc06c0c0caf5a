"""A checkpoint written on the GPU loads on the CPU, and one written on the CPU loads on the
GPU, bit for bit: weights and AdamW moments (the checkpoint stores tensors, not devices)."""

from __future__ import annotations

import pytest
import torch
from cuda_helpers import bitwise_equal, sft_datums

from posttrain.clients.create import create_training_client
from posttrain.clients.local import LocalTrainingClient
from posttrain.engine.executor import InProcessExecutor
from posttrain.types import AdamParams


def optimizer_state(client: LocalTrainingClient) -> dict[str, torch.Tensor]:
    """AdamW's moments and step counts by parameter name, on the CPU."""
    executor = client.dispatch.executor
    assert isinstance(executor, InProcessExecutor)
    worker = executor.workers[0]
    state = worker.optimizer.state
    out = {}
    for name, param in worker.trainable_parameters().items():
        for key, value in state[param].items():
            out[f"{name}/{key}"] = torch.as_tensor(value).detach().cpu().clone()
    return out


@pytest.mark.parametrize("rank", [8, None], ids=["lora", "full"])
def test_checkpoints_move_between_gpu_and_cpu_bit_exactly(tiny_model_dir, tmp_path, rank):
    def client(device: str, name: str) -> LocalTrainingClient:
        return create_training_client(
            tiny_model_dir, lora_rank=rank, device=device, storage_dir=tmp_path / name
        )

    gpu = client("cuda", "gpu")
    for seed in range(2):
        gpu.forward_backward(sft_datums(seed=seed), "cross_entropy").result()
        gpu.optim_step(AdamParams(learning_rate=1e-2)).result()
    saved = gpu.save_state("on-gpu").result().path
    cpu = client("cpu", "cpu")
    cpu.load_state_with_optimizer(saved).result()
    assert bitwise_equal(gpu.trainable_weights().result(), cpu.trainable_weights().result()) == []
    assert bitwise_equal(optimizer_state(gpu), optimizer_state(cpu)) == []
    assert optimizer_state(cpu), "the optimizer state really came across"

    # And back: the CPU trains one more step, saves, and a fresh GPU client loads it.
    cpu.forward_backward(sft_datums(seed=5), "cross_entropy").result()
    cpu.optim_step(AdamParams(learning_rate=1e-2)).result()
    saved = cpu.save_state("on-cpu").result().path
    back = client("cuda", "back")
    back.load_state_with_optimizer(saved).result()
    assert bitwise_equal(cpu.trainable_weights().result(), back.trainable_weights().result()) == []
    assert bitwise_equal(optimizer_state(cpu), optimizer_state(back)) == []
    executor = back.dispatch.executor
    assert isinstance(executor, InProcessExecutor)
    assert all(p.device.type == "cuda" for p in executor.workers[0].trainable_parameters().values())
    for made in (gpu, cpu, back):
        made.close()
