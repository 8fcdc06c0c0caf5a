"""`device="auto"` is CUDA where there is CUDA, and bf16 LoRA (fp32 adapters) trains there."""

from __future__ import annotations

import torch
from cuda_helpers import sft_datums

from posttrain.backends.local import LocalBackend
from posttrain.clients.create import create_training_client
from posttrain.engine.executor import InProcessExecutor
from posttrain.types import AdamParams


def test_auto_picks_cuda(tiny_model_dir, tmp_path):
    assert LocalBackend(tmp_path / "backend").device == "cuda"
    client = create_training_client(tiny_model_dir, lora_rank=4, storage_dir=tmp_path / "client")
    try:
        executor = client.dispatch.executor
        assert isinstance(executor, InProcessExecutor)
        assert {p.device.type for p in executor.workers[0].model.parameters()} == {"cuda"}
    finally:
        client.close()


def test_bf16_lora_trains_fp32_adapters_on_cuda(tiny_model_dir, tmp_path):
    client = create_training_client(
        tiny_model_dir, lora_rank=8, dtype="bfloat16", device="cuda", storage_dir=tmp_path
    )
    try:
        executor = client.dispatch.executor
        assert isinstance(executor, InProcessExecutor)
        worker = executor.workers[0]
        trainable = worker.trainable_parameters()
        frozen = [p for p in worker.model.parameters() if not p.requires_grad]
        assert trainable and all(p.dtype == torch.float32 for p in trainable.values())
        assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
        assert all(p.device.type == "cuda" for p in worker.model.parameters())
        datums = sft_datums()
        first = client.forward(datums, "cross_entropy").result().metrics["loss:sum"]
        for _ in range(30):
            client.forward_backward(datums, "cross_entropy").result()
            client.optim_step(AdamParams(learning_rate=1e-2)).result()
        last = client.forward(datums, "cross_entropy").result().metrics["loss:sum"]
        # Six random sequences memorised by rank-8 adapters: the mean loss per token (the
        # weights sum to 1) falls from ln(260) = 5.6 toward 0; a bf16 rounding that ate the
        # adapters' updates would leave it near 5.6. Asking for half leaves room for any GPU.
        assert first > 5.0
        assert last < first / 2, (first, last)
    finally:
        client.close()
