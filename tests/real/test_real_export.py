"""`posttrain export` of a LoRA run on the real model, checked against the libraries users load
it with: the merged directory with plain transformers, the adapter with PEFT on the base its
adapter_config.json names. The base is given as `packaged:smollm2-135m-instruct`, a name only
posttrain reads, so the adapter must name the model directory it stands for."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from real_model import NAME
from transformers import AutoModelForCausalLM

import posttrain
from posttrain.data.trajectories import TokenSegment, Trajectory

pytestmark = pytest.mark.slow

# Real logits reach ~30 here. The export holds W0 + s B A, summed once in fp32; the worker
# computes W0 x + s B (A x). The orders differ by ulps of each product, through 30 layers:
# measured 9.5e-5 at most (2026-11-28). Leaving the adapter out moves them by 10 after this
# update (measured; lr 1e-3 on a rank-8 adapter), so a wrong scale or a missed layer cannot pass.
ATOL = 5e-4
IDS = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 2, 198, 1, 4093, 198, 28120, 17]])


async def _train(base: str, root: Path) -> tuple[Path, torch.Tensor]:
    backend = posttrain.LocalBackend(root)
    model = posttrain.TrainableModel(name="m", project="p", base_model=base, lora_rank=8)
    await model.register(backend)
    ids = IDS[0].tolist()
    examples = [
        Trajectory((TokenSegment(tuple(ids[:9])), TokenSegment(tuple(ids[9:]), True)), 0.0),
        Trajectory((TokenSegment(tuple(ids[:4])), TokenSegment(tuple(ids[4:7]), True)), 0.0),
    ]
    await backend.train_sft(model, examples, learning_rate=1e-3, packing=True)
    worker = backend.client(model).dispatch.executor.workers[0]  # pyright: ignore[reportAttributeAccessIssue]
    with torch.no_grad():
        logits = worker.model(input_ids=IDS).logits.float().clone()
    await backend.close()
    return model.directory, logits


async def test_merged_and_adapter_exports_give_the_trained_logits(
    real_model_dir: Path, tmp_path: Path
):
    # The packaged name when the model came from the package (the case that needs resolving),
    # else the directory POSTTRAIN_REAL_MODEL_DIR names.
    base = str(real_model_dir) if os.environ.get("POSTTRAIN_REAL_MODEL_DIR") else f"packaged:{NAME}"
    model_dir, trained = await _train(base, tmp_path / "runs")

    posttrain.export_model(model_dir, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        gap = (merged(input_ids=IDS).logits - trained).abs().max().item()
    print(f"merged export vs trained, max abs logits gap: {gap:.3g}")
    assert gap < ATOL

    posttrain.export_model(model_dir, tmp_path / "adapter", mode="adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    named = Path(config["base_model_name_or_path"])
    assert named.is_dir() and named.resolve() == real_model_dir.resolve()
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(named), tmp_path / "adapter"
    ).eval()
    with torch.no_grad():
        gap = (peft(input_ids=IDS).logits - trained).abs().max().item()
    print(f"adapter export (PEFT) vs trained, max abs logits gap: {gap:.3g}")
    assert gap < ATOL
