"""train_attn / train_mlp / train_unembed from TrainableModel to the adapters LocalBackend and
TinkerBackend (-> posttrain serve's LoRA) train."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from posttrain.backends.local import LocalBackend
from posttrain.backends.model import TrainableModel
from posttrain.backends.tinker import wire_train_unembed
from posttrain.models.lora import ATTN_MODULES, MLP_MODULES, UNEMBED_MODULES


def adapted(names) -> set[str]:
    """Which module kinds carry LoRA weights among parameter names."""
    kinds = {"attn": ATTN_MODULES, "mlp": MLP_MODULES, "unembed": UNEMBED_MODULES}
    return {
        kind
        for kind, modules in kinds.items()
        if any(f".{m}." in n and "lora_" in n for n in names for m in modules)
    }


def model(tiny_model_dir, **flags) -> TrainableModel:
    return TrainableModel(
        name="m", project="p", base_model=str(tiny_model_dir), lora_rank=4, **flags
    )


async def test_local_backend_adapts_the_chosen_layers(tiny_model_dir, tmp_path):
    for flags, expected in [
        ({}, {"attn", "mlp", "unembed"}),
        ({"train_mlp": False}, {"attn", "unembed"}),
        ({"train_attn": False, "train_unembed": False}, {"mlp"}),
    ]:
        backend = LocalBackend(tmp_path / str(len(expected)) / "-".join(sorted(flags)))
        m = model(tiny_model_dir, **flags)
        await m.register(backend)
        worker = backend.client(m).dispatch.executor.workers[0]  # pyright: ignore[reportAttributeAccessIssue]
        assert adapted(worker.trainable_parameters()) == expected, flags
        await backend.close()


async def test_a_tied_unembedding_is_adapted_only_when_asked(tied_model_dir, tmp_path):
    """train_unembed None (the default) leaves a tied model's shared matrix alone; True adapts
    it, through the embedding's adapter that lm_head shares (`models.load.apply_lora`)."""
    for flags, expected in [({}, {"attn", "mlp"}), ({"train_unembed": True}, {"attn", "mlp"})]:
        backend = LocalBackend(tmp_path / str(len(flags)))
        m = model(tied_model_dir, **flags)
        await m.register(backend)
        names = backend.client(m).dispatch.executor.workers[0].trainable_parameters()  # pyright: ignore[reportAttributeAccessIssue]
        assert adapted(names) == expected, flags
        assert any("embed_tokens.lora_embedding" in n for n in names) == bool(flags)
        await backend.close()


def test_tinker_backend_resolves_the_default_before_the_wire(tiny_model_dir, tied_model_dir):
    """Tinker's wire takes a bool (True by default): None becomes what LocalBackend adapts."""
    assert wire_train_unembed(model(tiny_model_dir)) is True
    assert wire_train_unembed(model(tied_model_dir)) is False
    assert wire_train_unembed(model(tied_model_dir, train_unembed=True)) is True
    assert wire_train_unembed(model(tiny_model_dir, train_unembed=False)) is False


def test_bad_layer_choices_are_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="at least one of train_attn"):
        model(tiny_model_dir, train_attn=False, train_mlp=False, train_unembed=False)
    with pytest.raises(ValueError, match="lora_rank is None"):
        TrainableModel(name="m", project="p", base_model="x", lora_rank=None, train_mlp=False)
    with pytest.raises(ValueError, match="train_mlp must be a bool"):
        model(tiny_model_dir, train_mlp="no")
    with pytest.raises(ValueError, match="train_unembed must be a bool or None"):
        model(tiny_model_dir, train_unembed="no")


@pytest.mark.slow
async def test_tinker_backend_sends_them_to_posttrain_serve(tiny_model_dir, tmp_path):
    pytest.importorskip("tinker")
    from safetensors.torch import load_file

    from posttrain.backends.tinker import TinkerBackend

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
    from serve_helpers import KEY, start_server  # pyright: ignore[reportMissingImports]

    server = start_server(tiny_model_dir, tmp_path / "storage")
    try:
        backend = TinkerBackend(tmp_path / "b", base_url=server.url, api_key=KEY)
        m = model(tiny_model_dir, train_mlp=False)
        await m.register(backend)
        path = await backend.checkpoint(m)
        saved = load_file(server.checkpoint_dir(path) / "adapter_model.safetensors")
        assert adapted(saved) == {"attn", "unembed"}
        await backend.close()
    finally:
        server.stop()
