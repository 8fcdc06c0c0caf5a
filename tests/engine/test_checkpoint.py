"""Checkpoints: exact resume, PEFT compatibility, atomic writes, clear errors, retention."""

from __future__ import annotations

import os
import random
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from posttrain.engine import atomic_replace, checkpoint
from posttrain.engine.checkpoint import (
    checkpoint_kind,
    is_complete_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    save_weights,
)
from posttrain.engine.optim import create_adamw_optimizer
from posttrain.models.load import LoraSettings, apply_lora, load_hf_model

# Every target kind, the unembedding included (the test model's own, untied).
LORA = LoraSettings(rank=4, alpha=8, train_attn=True, train_mlp=True, train_unembed=True)


def _build(base: Path, kind: str, *, seed: int = 0, lora: LoraSettings = LORA):
    """A fresh model + AdamW; `seed` drives the LoRA A initialisation."""
    torch.manual_seed(seed)
    model = load_hf_model(base)
    if kind == "lora":
        model = apply_lora(model, lora)
    params = [p for p in model.parameters() if p.requires_grad]
    # Weight decay on, so the decoupled decay path is part of what must resume exactly.
    optimizer = create_adamw_optimizer(
        params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1
    )
    return model, optimizer


def _train(model, optimizer, steps: int) -> None:
    """AdamW steps on batches drawn from the global torch RNG, so resuming needs the RNG too."""
    for _ in range(steps):
        ids_BT = torch.randint(0, 256, (2, 12))
        model(input_ids=ids_BT, labels=ids_BT).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _leftovers(directory: Path) -> list[str]:
    """Hidden temp/old/deleting directories a save or prune may have left behind."""
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


@pytest.fixture(scope="module")
def lora_model(tiny_model_dir: Path):
    model, optimizer = _build(tiny_model_dir, "lora")
    torch.manual_seed(0)
    _train(model, optimizer, 2)  # lora_B starts at zero; train so the adapter is not a no-op
    return model, optimizer


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_resume_is_bit_identical_to_an_uninterrupted_run(
    tiny_model_dir: Path, tmp_path: Path, kind: str
) -> None:
    model, optimizer = _build(tiny_model_dir, kind)
    torch.manual_seed(123)
    _train(model, optimizer, 5)
    expected = model.state_dict()

    model, optimizer = _build(tiny_model_dir, kind)
    torch.manual_seed(123)
    _train(model, optimizer, 3)
    path = save_checkpoint(
        tmp_path / "3",
        model=model,
        optimizer=optimizer,
        trainer_state={"step": 3, "cursor": [1, 2]},
    )
    assert checkpoint_kind(path) == kind

    # A different seed gives the new LoRA a different A init and the RNG a different stream:
    # only a complete restore of weights, optimizer and RNG can reproduce the run.
    resumed, resumed_optimizer = _build(tiny_model_dir, kind, seed=1)
    state = load_checkpoint(path, model=resumed, optimizer=resumed_optimizer)
    assert state == {"step": 3, "cursor": [1, 2]}
    _train(resumed, resumed_optimizer, 2)

    # Same bits in, same deterministic CPU kernels: the runs agree exactly, no tolerance.
    got = resumed.state_dict()
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_rng_state_is_restored(lora_model, tmp_path: Path) -> None:
    model, _ = lora_model
    path = save_checkpoint(tmp_path / "ck", model=model)
    after_save = (torch.rand(4), random.random(), np.random.rand(3))
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    load_checkpoint(path, model=model)
    after_load = (torch.rand(4), random.random(), np.random.rand(3))
    assert torch.equal(after_load[0], after_save[0])
    assert after_load[1] == after_save[1]
    np.testing.assert_array_equal(after_load[2], after_save[2])


def test_optimizer_state_loads_by_name_in_any_parameter_order(lora_model, tmp_path: Path) -> None:
    model, optimizer = lora_model
    path = save_checkpoint(tmp_path / "ck", model=model, optimizer=optimizer, include_rng=False)
    names = {id(p): n for n, p in model.named_parameters()}
    before = {
        names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()
    }

    params = [p for p in model.parameters() if p.requires_grad]
    reversed_optimizer = torch.optim.AdamW(list(reversed(params)), lr=0.5)
    load_checkpoint(path, model=model, optimizer=reversed_optimizer, restore_rng=False)

    after = {names[id(p)]: s for p, s in reversed_optimizer.state.items()}
    assert after.keys() == before.keys()
    for name, state in before.items():
        for key, value in state.items():
            assert torch.equal(after[name][key], value), (name, key)
    assert reversed_optimizer.param_groups[0]["lr"] == 1e-2  # hyperparameters come back too

    subset_optimizer = torch.optim.AdamW(params[:2])
    with pytest.raises(ValueError, match="does not match the optimizer's parameter groups"):
        load_checkpoint(path, model=model, optimizer=subset_optimizer, restore_rng=False)


def test_adapter_is_what_peft_writes_and_loads_with_plain_peft(
    lora_model, tiny_model_dir: Path, tmp_path: Path
) -> None:
    model, _ = lora_model
    path = save_weights(tmp_path / "sampler", model)
    # PEFT's own writing, less the base weight of the targeted lm_head that its default adds.
    model.save_pretrained(tmp_path / "peft", save_embedding_layers=False)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (path / name).read_bytes() == (tmp_path / "peft" / name).read_bytes(), name
    saved = load_file(path / "adapter_model.safetensors")
    assert any(".lm_head.lora_A." in key for key in saved)  # the untied unembedding's adapter
    assert all("lora_" in key for key in saved), sorted(saved)  # and no base weight

    base = load_hf_model(tiny_model_dir)
    ids_BT = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        base_BTV = base(input_ids=ids_BT).logits
        plain = PeftModel.from_pretrained(base, path)
        model.eval()
        want_BTV = model(input_ids=ids_BT).logits
        got_BTV = plain(input_ids=ids_BT).logits
    model.train()
    # The trained adapter moves the logits, so agreement below is not the base model twice.
    assert (want_BTV - base_BTV).abs().max().item() > 1e-3
    # Identical fp32 weights and kernels give identical logits (measured diff 0.0); 1e-6 leaves
    # room only for a different summation order, never for a wrong or missing weight.
    assert (got_BTV - want_BTV).abs().max().item() <= 1e-6


def test_full_weights_load_with_from_pretrained(tiny_model_dir: Path, tmp_path: Path) -> None:
    model, optimizer = _build(tiny_model_dir, "full")
    _train(model, optimizer, 1)
    path = save_weights(tmp_path / "sampler", model)
    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for name, value in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name


def test_a_checkpoint_has_the_umasks_modes(
    lora_model, tiny_model_dir: Path, tmp_path: Path, wrong_modes
) -> None:
    # PEFT's and transformers' save_pretrained write safetensors 0600, mkdtemp the folder 0700.
    model, optimizer = lora_model
    assert wrong_modes(save_checkpoint(tmp_path / "lora", model=model, optimizer=optimizer)) == {}
    full, _ = _build(tiny_model_dir, "full")
    assert wrong_modes(save_weights(tmp_path / "full", full)) == {}


def test_crash_mid_save_leaves_nothing(lora_model, tmp_path: Path, monkeypatch) -> None:
    model, optimizer = lora_model

    def crash() -> dict[str, object]:
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "rng_state", crash)  # after the weights are written
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path / "run" / "3", model=model, optimizer=optimizer)
    assert not (tmp_path / "run" / "3").exists()
    assert list((tmp_path / "run").iterdir()) == []


def test_crash_while_replacing_keeps_the_old_checkpoint(
    lora_model, tmp_path: Path, monkeypatch
) -> None:
    model, _ = lora_model
    path = save_checkpoint(tmp_path / "ck", model=model, trainer_state={"step": 1})

    def crash(*args, **kwargs) -> None:
        raise OSError("power cut")

    monkeypatch.setattr(checkpoint, "_write_manifest", crash)
    with pytest.raises(OSError, match="power cut"):
        save_checkpoint(path, model=model, trainer_state={"step": 2})
    monkeypatch.undo()

    def failing_exchange(a, b) -> bool:
        raise OSError("power cut during exchange")

    monkeypatch.setattr(atomic_replace, "_exchange", failing_exchange)
    with pytest.raises(OSError, match="power cut during exchange"):
        save_checkpoint(path, model=model, trainer_state={"step": 2})
    # Without an atomic exchange (not Linux): two renames, the second one failing.
    monkeypatch.setattr(atomic_replace, "_exchange", lambda a, b: False)
    real_rename = os.rename

    def failing_swap(src, dst) -> None:
        if ".tmp-" in Path(src).name:  # the new checkpoint's rename into place
            raise OSError("power cut during swap")
        real_rename(src, dst)

    monkeypatch.setattr(atomic_replace.os, "rename", failing_swap)
    with pytest.raises(OSError, match="power cut during swap"):
        save_checkpoint(path, model=model, trainer_state={"step": 2})
    monkeypatch.undo()

    assert is_complete_checkpoint(path)
    assert load_checkpoint(path, model=model) == {"step": 1}
    assert _leftovers(tmp_path) == []


def test_save_replaces_an_existing_checkpoint(lora_model, tmp_path: Path) -> None:
    model, _ = lora_model
    path = save_checkpoint(tmp_path / "ck", model=model, trainer_state={"step": 1})
    save_checkpoint(path, model=model, trainer_state={"step": 2})
    assert load_checkpoint(path, model=model) == {"step": 2}
    assert _leftovers(tmp_path) == []


def test_save_refuses_bad_targets_and_state_before_writing(lora_model, tmp_path: Path) -> None:
    model, _ = lora_model
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keep.txt").write_text("user data")
    with pytest.raises(ValueError, match="not a checkpoint"):
        save_checkpoint(tmp_path / "data", model=model)
    assert (tmp_path / "data" / "keep.txt").read_text() == "user data"
    with pytest.raises(ValueError, match="reserved key 'format_version'"):
        save_checkpoint(tmp_path / "a", model=model, trainer_state={"format_version": 3})
    with pytest.raises(ValueError, match="JSON-serialisable"):
        save_checkpoint(tmp_path / "b", model=model, trainer_state={"step": float("nan")})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_missing_or_incomplete_checkpoints_are_errors(lora_model, tmp_path: Path) -> None:
    model, optimizer = lora_model
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        load_checkpoint(tmp_path / "nope", model=model)

    path = save_checkpoint(tmp_path / "ck", model=model, optimizer=optimizer)
    (path / "adapter_model.safetensors").unlink()
    assert not is_complete_checkpoint(path)
    with pytest.raises(ValueError, match=r"incomplete checkpoint at .*ck: missing adapter_model"):
        load_checkpoint(path, model=model)

    path = save_checkpoint(tmp_path / "ck2", model=model)
    (path / "checkpoint.json").unlink()
    with pytest.raises(
        ValueError, match=r"incomplete checkpoint at .*ck2: checkpoint.json is missing"
    ):
        load_checkpoint(path, model=model)

    path = save_checkpoint(tmp_path / "ck3", model=model)
    with (path / "trainer_state.json").open("a") as f:
        f.write(" ")
    with pytest.raises(ValueError, match=r"size differs .* trainer_state\.json"):
        load_checkpoint(path, model=model)


def test_what_was_not_saved_cannot_be_loaded(lora_model, tmp_path: Path) -> None:
    model, optimizer = lora_model
    path = save_weights(tmp_path / "sampler", model)
    with pytest.raises(ValueError, match="no optimizer state"):
        load_checkpoint(path, model=model, optimizer=optimizer, restore_rng=False)
    with pytest.raises(ValueError, match="no RNG state"):
        load_checkpoint(path, model=model)
    assert load_checkpoint(path, model=model, restore_rng=False) == {}


def test_kind_and_adapter_mismatches_are_errors(
    lora_model, tiny_model_dir: Path, tmp_path: Path
) -> None:
    model, _ = lora_model
    lora_path = save_weights(tmp_path / "lora", model)
    full_model = load_hf_model(tiny_model_dir)
    full_path = save_weights(tmp_path / "full", full_model)
    with pytest.raises(ValueError, match=r"holds a LoRA adapter but the model is a full model"):
        load_checkpoint(lora_path, model=full_model, restore_rng=False)
    with pytest.raises(ValueError, match=r"holds full model weights but the model is a LoRA"):
        load_checkpoint(full_path, model=model, restore_rng=False)

    rank8 = LoraSettings(rank=8, alpha=8, train_attn=True, train_mlp=True, train_unembed=True)
    other, _ = _build(tiny_model_dir, "lora", lora=rank8)
    with pytest.raises(ValueError, match=r"does not match the model's adapter: r: checkpoint 4"):
        load_checkpoint(lora_path, model=other, restore_rng=False)
    attn_only = LoraSettings(rank=4, alpha=8, train_attn=True, train_mlp=False, train_unembed=True)
    other, _ = _build(tiny_model_dir, "lora", lora=attn_only)
    with pytest.raises(ValueError, match="target_modules"):
        load_checkpoint(lora_path, model=other, restore_rng=False)


def test_list_and_prune_keep_the_newest(lora_model, tmp_path: Path) -> None:
    model, _ = lora_model
    for step in (1, 2, 10, 3):
        save_weights(tmp_path / str(step), model)
    (tmp_path / "11").mkdir()  # incomplete: no manifest, never listed, never pruned
    save_weights(tmp_path / "best", model)  # not a step name
    # What a killed writer leaves: a half-written and a half-deleted checkpoint (hidden).
    (tmp_path / ".12.tmp-abc").mkdir()
    (tmp_path / ".0.deleting-def").mkdir()
    # Numeric order (10 after 3), not lexical.
    assert [p.name for p in list_checkpoints(tmp_path)] == ["1", "2", "3", "10"]
    assert list_checkpoints(tmp_path / "absent") == []

    deleted = prune_checkpoints(tmp_path, keep_last=2)
    assert [p.name for p in deleted] == ["1", "2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["10", "11", "3", "best"]
    assert prune_checkpoints(tmp_path, keep_last=5) == []
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        prune_checkpoints(tmp_path, keep_last=0)


def _old_copy(path: Path) -> Path:
    """Move a checkpoint aside as a kill between the two renames of a replacement leaves it."""
    return path.rename(path.with_name(f".{path.name}.old-{uuid.uuid4().hex}"))


def test_a_replacement_killed_between_its_renames_is_undone_by_every_reader(
    lora_model, tmp_path: Path
) -> None:
    model, _ = lora_model
    for look_up in (
        lambda p: load_checkpoint(p, model=model),
        lambda p: is_complete_checkpoint(p) or pytest.fail("not complete"),
        lambda p: checkpoint_kind(p),
        lambda p: list_checkpoints(p.parent) == [p] or pytest.fail("not listed"),
        lambda p: prune_checkpoints(p.parent, keep_last=1),
        lambda p: save_checkpoint(p, model=model, trainer_state={"step": 7}),
    ):
        path = save_checkpoint(tmp_path / "7", model=model, trainer_state={"step": 7})
        _old_copy(path)
        look_up(path)
        assert load_checkpoint(path, model=model) == {"step": 7}
        assert _leftovers(tmp_path) == []
    # A complete checkpoint under the name: the old copy is what is left over, and goes.
    stale = _old_copy(save_checkpoint(tmp_path / "8", model=model, trainer_state={"step": 1}))
    save_checkpoint(tmp_path / "8", model=model, trainer_state={"step": 2})
    assert list_checkpoints(tmp_path) == [tmp_path / "7", tmp_path / "8"]
    assert not stale.exists() and _leftovers(tmp_path) == []
    assert load_checkpoint(tmp_path / "8", model=model) == {"step": 2}


def test_a_save_deletes_what_a_killed_save_of_its_name_left(lora_model, tmp_path: Path) -> None:
    model, _ = lora_model
    for debris in (".openai.tmp-k1ll3d", ".openai.deleting-0f", ".other.tmp-abc123"):
        (tmp_path / debris).mkdir()
    save_weights(tmp_path / "openai", model)
    assert _leftovers(tmp_path) == [".other.tmp-abc123"]  # another name's: not ours to judge


def test_loads_see_one_whole_checkpoint_while_another_thread_replaces_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A load reads one checkpoint's files, never half the old and half the new ones."""
    versions = []
    for seed in (1, 2):
        model, _ = _build(tiny_model_dir, "lora", seed=seed)
        versions.append((model, {n: p.detach().clone() for n, p in model.named_parameters()}))
    probe, _ = _build(tiny_model_dir, "lora", seed=3)
    path = save_checkpoint(tmp_path / "ck", model=versions[0][0], trainer_state={"v": 0})
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            i = 1 - i
            save_checkpoint(path, model=versions[i][0], trainer_state={"v": i})

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(30):
            v = load_checkpoint(path, model=probe, restore_rng=False)["v"]
            assert isinstance(v, int)
            for name, value in probe.named_parameters():
                assert torch.equal(value, versions[v][1][name]), name
    finally:
        stop.set()
        thread.join()
