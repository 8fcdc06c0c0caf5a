"""Sync what changed: the update files an engine in a worker process takes each step, and the
split pytorch engine's in-place merge of them (`inference/updates.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.clients.create import create_training_client
from posttrain.inference.adapters import split_adapter
from posttrain.inference.pytorch_runner import PytorchRunner
from posttrain.inference.updates import BaseWeights, UpdateExporter, resolve_update
from posttrain.inference.weights import base_weights_for_merge, merge_trainable
from posttrain.models.lora import LoraSettings
from posttrain.models.tiny import tiny_model_path


def _trained(lora_rank: int, train_unembed: bool = True) -> tuple[Path, dict[str, torch.Tensor]]:
    """The tiny model's trainable tensors, set to random values (a trained adapter's stand-in:
    a fresh LoRA's B is zero, which would merge to the base weights and prove nothing)."""
    base = tiny_model_path(arch="qwen2")
    client = create_training_client(
        str(base), lora_rank=lora_rank, lora_alpha=8, train_unembed=train_unembed
    )
    weights = client.trainable_weights().result()
    generator = torch.Generator().manual_seed(0)
    return base, {k: 0.1 * torch.randn(v.shape, generator=generator) for k, v in weights.items()}


def _exporter(tmp_path: Path, base: Path, lora_rank: int | None, route: str) -> UpdateExporter:
    return UpdateExporter(
        tmp_path / "updates",
        base_model=str(base),
        lora=LoraSettings.of(lora_rank, 8),
        route=route,  # pyright: ignore[reportArgumentType]
        dtype="float32",
        keep=2,
    )


def test_adapter_route_writes_the_adapter_and_the_unembedding_factors_only(tmp_path: Path):
    base, weights = _trained(4)
    exporter = _exporter(tmp_path, base, 4, "adapter")
    snapshot = exporter.export(weights, 1)
    assert snapshot.kind == "update" and snapshot.adapter is not None
    assert snapshot.tensors is not None and snapshot.lora_scale == 2.0
    # Bytes: the adapter's fp32 factors, plus lm_head's two factors, plus small headers.
    split = split_adapter(weights)
    other = sum(t.numel() * 4 for t in split.other.values())
    assert split.adapter_bytes + other <= snapshot.bytes <= 2 * split.adapter_bytes
    # The engine's view (adapter merged as well) equals the whole-model merge exactly: both
    # sum W0 + s B A in float32.
    whole = merge_trainable(base_weights_for_merge(base)[0], weights, lora_scale=2.0)
    resolved = resolve_update(
        BaseWeights(base),
        adapter=snapshot.adapter,
        tensors=snapshot.tensors,
        lora_scale=snapshot.lora_scale,
        merge_adapter=True,
    )
    assert len(resolved) == len(weights) // 2  # one whole tensor per LoRA pair
    for name, tensor in resolved.items():
        assert torch.equal(tensor, whole[name]), name
    # Without merge_adapter only the unembedding is merged (the engine loads the adapter).
    unembed = resolve_update(
        BaseWeights(base),
        adapter=snapshot.adapter,
        tensors=snapshot.tensors,
        lora_scale=2.0,
        merge_adapter=False,
    )
    assert list(unembed) == ["lm_head.weight"]
    # Only the newest `keep` versions stay on disk.
    for version in (2, 3):
        exporter.export(weights, version)
    assert sorted(p.name for p in exporter.directory.iterdir()) == ["v2", "v3"]
    exporter.close()


def test_merge_route_ships_every_factor_and_no_adapter(tmp_path: Path):
    base, weights = _trained(4, train_unembed=False)
    snapshot = _exporter(tmp_path, base, 4, "merge").export(weights, 1)
    assert snapshot.adapter is None and snapshot.tensors is not None
    assert snapshot.bytes <= 2 * split_adapter(weights).adapter_bytes


def test_split_pytorch_engine_merges_an_update_in_place_and_keeps_the_rest(tmp_path: Path):
    """The worker's model after an update equals the whole-model merge for every tensor, and a
    partial full-fine-tuning update changes only the tensors it names."""
    base, weights = _trained(4)
    options = {"model_dir": str(base), "dtype": "float32", "device": "cpu"}
    runner = PytorchRunner(options)
    snapshot = _exporter(tmp_path, base, 4, "adapter").export(weights, 1)
    request = {
        "kind": "update",
        "adapter": str(snapshot.adapter),
        "tensors": str(snapshot.tensors),
        "lora_scale": snapshot.lora_scale,
    }
    assert runner.update(request) == []
    whole = merge_trainable(base_weights_for_merge(base)[0], weights, lora_scale=2.0)
    state = runner.sampler.model.state_dict()
    for name, tensor in whole.items():
        assert torch.equal(state[name], tensor), name

    before: dict[str, torch.Tensor] = {
        k: v.clone() for k, v in runner.sampler.model.state_dict().items()
    }
    partial: dict[str, torch.Tensor] = {
        "model.layers.0.self_attn.q_proj.weight": torch.full_like(
            before["model.layers.0.self_attn.q_proj.weight"], 0.5
        ),
        "model.norm.weight": torch.full_like(before["model.norm.weight"], 2.0),
    }
    full = _exporter(tmp_path / "full", base, None, "merge").export(partial, 2)
    runner.update({"kind": "update", "adapter": None, "tensors": str(full.tensors)})
    after = runner.sampler.model.state_dict()
    for name, tensor in before.items():
        assert torch.equal(after[name], partial.get(name, tensor)), name


def test_an_update_naming_an_unknown_tensor_is_refused(tmp_path: Path):
    base, _ = _trained(4)
    runner = PytorchRunner({"model_dir": str(base), "dtype": "float32", "device": "cpu"})
    bad = _exporter(tmp_path, base, None, "merge").export({"model.nope.weight": torch.ones(2)}, 1)
    with pytest.raises(KeyError, match=r"model\.nope\.weight"):
        runner.update({"kind": "update", "adapter": None, "tensors": str(bad.tensors)})


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [4, None], ids=["lora", "full"])
async def test_split_engine_after_syncs_samples_the_trainers_policy(
    tiny_model_dir: Path, tmp_path: Path, lora_rank: int | None
):
    """Three synced steps through the split engine (LoRA with lm_head, or full fine-tuning):
    its logprobs equal the trainer's within 1e-5 (fp32; the worker runs 1 thread, the trainer
    its own count), and each sync moved the trainable tensors only."""
    from tests.inference.engine_helpers import train_one_step, worst_logprob_gap

    import posttrain
    from posttrain.types import SamplingParams

    backend = posttrain.LocalBackend(tmp_path, inference={"devices": "cpu,cpu", "threads": 1})
    model = posttrain.TrainableModel(
        name="m", project="p", base_model=str(tiny_model_dir), lora_rank=lora_rank, seed=0
    )
    await model.register(backend)
    try:
        for step in range(3):
            await train_one_step(backend, model, content="abc", seed=step, learning_rate=0.02)
        client = backend.client(model)
        sync = backend._models.engine(model).last_sync
        weights = await client.trainable_weights()
        trainable = sum(t.numel() * t.element_size() for t in weights.values())
        assert sync["sync_version"] == 3
        # The trainable tensors' bytes, plus the safetensors header (names, shapes: ~4 KiB).
        assert trainable <= sync["sync_bytes"] <= trainable + 16 * 1024
        prompts = [[72, 101, 108, 108, 111], [97, 98]]
        sampler = backend.sampling_client(model)
        responses = await sampler.sample_many(
            prompts, 2, SamplingParams(max_tokens=8, seed=3, stop=[])
        )
        assert await worst_logprob_gap(client, prompts, responses) <= 1e-5
    finally:
        await backend.close()
