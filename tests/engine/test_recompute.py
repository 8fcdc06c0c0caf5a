"""Gradient checkpointing (`engine.recompute`): the same gradients, shared prefixes included."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from posttrain.algo.losses import LossConfig
from posttrain.engine import recompute
from posttrain.engine.recompute import enable_gradient_checkpointing
from posttrain.engine.shared_prefix import plan_micro_batches
from posttrain.engine.worker import Worker, WorkerConfig
from posttrain.models.load import LoraSettings, apply_lora, load_hf_model
from posttrain.types import Datum, ModelInput


def datums() -> list[Datum]:
    """Two prompts of 12 tokens with 3 completions each (shared-prefix groups), and 2 lone rows."""
    gen = torch.Generator().manual_seed(0)
    rows: list[list[int]] = []
    for _ in range(2):
        prompt = torch.randint(3, 250, (12,), generator=gen).tolist()
        rows += [prompt + torch.randint(3, 250, (n,), generator=gen).tolist() for n in (5, 9, 3)]
    rows += [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (7, 16)]
    return [
        Datum(
            ModelInput.from_ints(ids[:-1]),
            {
                "target_tokens": torch.tensor(ids[1:]),
                "weights": torch.rand(len(ids) - 1, generator=gen),
            },
        )
        for ids in rows
    ]


def gradients(worker: Worker) -> dict[str, torch.Tensor]:
    worker.forward_backward(datums(), "cross_entropy", LossConfig())
    return {n: g.clone() for n, g in worker.grads().items() if g is not None}


@pytest.mark.parametrize("lora", [False, True])
def test_same_gradients_with_and_without_checkpointing(tiny_model_dir: Path, lora: bool) -> None:
    model = load_hf_model(tiny_model_dir)
    if lora:
        model = apply_lora(model, LoraSettings(rank=4), seed=0)
    config = WorkerConfig(micro_batch_tokens=64)
    plain = Worker(copy.deepcopy(model), config)
    recomputed = Worker(model, WorkerConfig(micro_batch_tokens=64, gradient_checkpointing=True))
    plan = plan_micro_batches([d.model_input.to_ints() for d in datums()], 64, 8)
    assert any(g.shared for micro in plan for g in micro.groups)  # the cache path is exercised
    expected, got = gradients(plain), gradients(recomputed)
    assert got.keys() == expected.keys() and expected
    # The replay runs the same float32 operations in the same order as the forward, so the
    # gradients agree to fp32 rounding (1e-6 relative), and in practice bit for bit.
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-6, atol=1e-9)


def test_layers_recompute_only_when_training_with_gradients(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_hf_model(tiny_model_dir)
    assert enable_gradient_checkpointing(model) == 2  # the tiny model's two decoder layers
    checkpointed: list[int] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        checkpointed.append(1)
        return checkpoint(*args, **kwargs)

    monkeypatch.setattr(recompute, "checkpoint", counting)
    ids_BT = torch.tensor([[5, 6, 7, 8]])
    model.train()
    model(input_ids=ids_BT).logits.sum().backward()
    assert len(checkpointed) == 2  # one per layer
    with torch.no_grad():
        model(input_ids=ids_BT)
    model.eval()
    model(input_ids=ids_BT).logits.sum().backward()
    assert len(checkpointed) == 2  # without gradients, or in eval mode: run as they are
    copied = copy.deepcopy(model)
    layer = copied.model.layers[0]
    assert layer.forward.__self__ is layer  # the copy's layers checkpoint themselves


def test_a_model_without_decoder_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="no transformers decoder layers"):
        enable_gradient_checkpointing(torch.nn.Linear(2, 2))
