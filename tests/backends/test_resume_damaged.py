"""Registering over a damaged latest checkpoint is an error that names it; `resume_step` is the
explicit way past it; debris of an interrupted write is still cleaned up quietly."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest
import torch
from local_groups import synthetic_groups, weights_of

from posttrain.backends.local import LocalBackend
from posttrain.backends.resume import DamagedCheckpointError
from posttrain.engine.checkpoint import MANIFEST, is_complete_checkpoint
from posttrain.model import TrainableModel

ADAPTER = "adapter_model.safetensors"


def _model(base: Path) -> TrainableModel:
    return TrainableModel(name="m", project="p", base_model=str(base), lora_rank=4)


async def _trained(base: Path, path: Path, steps: int) -> list[dict[str, torch.Tensor]]:
    """Train `steps` steps, every checkpoint kept; the weights after each step (0: initial)."""
    backend = LocalBackend(path, keep_checkpoints=10)
    model = _model(base)
    await model.register(backend)
    weights = [weights_of(backend, model)]
    for step in range(steps):
        await backend.train(model, synthetic_groups(step), learning_rate=1e-2)
        weights.append(weights_of(backend, model))
    await backend.close()
    return weights


async def _register(base: Path, path: Path, **kwargs) -> tuple[LocalBackend, TrainableModel]:
    backend = LocalBackend(path)
    model = _model(base)
    await model.register(backend, **kwargs)
    return backend, model


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _delete_adapter(checkpoint: Path) -> None:
    (checkpoint / ADAPTER).unlink()


def _truncate_weights(checkpoint: Path) -> None:
    os.truncate(checkpoint / ADAPTER, (checkpoint / ADAPTER).stat().st_size // 2)


def _drop_manifest(checkpoint: Path) -> None:
    (checkpoint / MANIFEST).unlink()  # a half-written step directory, not a hidden .tmp- one


DAMAGE = {
    "deleted adapter": (_delete_adapter, f"missing {ADAPTER}"),
    "truncated weights": (_truncate_weights, f"size differs from {MANIFEST} for {ADAPTER}"),
    "no manifest": (_drop_manifest, f"{MANIFEST} is missing"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
async def test_a_damaged_latest_checkpoint_is_an_error_naming_it_and_the_way_out(
    tiny_model_dir: Path, tmp_path: Path, damage: str
) -> None:
    weights = await _trained(tiny_model_dir, tmp_path, steps=2)
    checkpoints = tmp_path / "p" / "models" / "m" / "checkpoints"
    harm, what = DAMAGE[damage]
    harm(checkpoints / "2")
    backend = LocalBackend(tmp_path)
    model = _model(tiny_model_dir)
    with pytest.raises(DamagedCheckpointError) as caught:
        await model.register(backend)
    message = str(caught.value)
    assert f"latest checkpoint {checkpoints / '2'} is damaged" in message
    assert what in message
    assert "resume_step=1" in message and "--resume-step 1" in message
    assert model.step == 0 and model.run_state == {}  # not registered, nothing resumed
    with pytest.raises(RuntimeError, match="not registered"):
        backend.client(model)

    # The way out it names: step 1, exactly; step 2 is moved aside, whole, not deleted.
    await model.register(backend, resume_step=1)
    assert model.step == 1 and _same(weights_of(backend, model), weights[1])
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        "1",
        next(p.name for p in checkpoints.iterdir() if p.name.startswith("set-aside-after-step-1")),
    ]
    aside = next(checkpoints.glob("set-aside-after-step-1-*"))
    assert [p.name for p in aside.iterdir()] == ["2"]
    # Training goes on from there, and the next registration resumes it without a word.
    await backend.train(model, synthetic_groups(1), learning_rate=1e-2)
    retrained = weights_of(backend, model)
    await backend.close()
    backend, model = await _register(tiny_model_dir, tmp_path)
    assert model.step == 2 and _same(weights_of(backend, model), retrained)
    # Same data, same start, same kernels: the step is redone bit for bit.
    assert _same(retrained, weights[2])
    await backend.close()


async def test_a_damaged_only_checkpoint_never_falls_back_to_the_base_model_silently(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    weights = await _trained(tiny_model_dir, tmp_path, steps=1)
    checkpoints = tmp_path / "p" / "models" / "m" / "checkpoints"
    _delete_adapter(checkpoints / "1")
    with pytest.raises(DamagedCheckpointError, match=r"start again from the base model") as caught:
        await _register(tiny_model_dir, tmp_path)
    assert "resume_step=0" in str(caught.value)
    backend, model = await _register(tiny_model_dir, tmp_path, resume_step=0)
    assert model.step == 0 and _same(weights_of(backend, model), weights[0])
    assert not (checkpoints / "1").exists()
    assert len(list(checkpoints.glob("set-aside-after-step-0-*/1"))) == 1
    await backend.close()


async def test_resume_step_must_name_a_complete_checkpoint(tiny_model_dir: Path, tmp_path: Path):
    await _trained(tiny_model_dir, tmp_path, steps=2)
    checkpoints = tmp_path / "p" / "models" / "m" / "checkpoints"
    _delete_adapter(checkpoints / "1")
    for step, problem in ((5, "no checkpoint at"), (1, f"missing {ADAPTER}")):
        with pytest.raises(ValueError, match=problem) as caught:
            await _register(tiny_model_dir, tmp_path, resume_step=step)
        assert "Complete checkpoints in" in str(caught.value) and "['2']" in str(caught.value)
    with pytest.raises(ValueError, match="resume_step must be a step number >= 0"):
        await _register(tiny_model_dir, tmp_path, resume_step=-1)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["1", "2"]  # nothing moved


async def test_debris_of_an_interrupted_write_is_cleaned_quietly(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    weights = await _trained(tiny_model_dir, tmp_path, steps=2)
    checkpoints = tmp_path / "p" / "models" / "m" / "checkpoints"
    # A kill mid-write of step 3, mid-prune of step 0, and between the two renames that replace
    # step 2 (where there is no atomic exchange): step 2 is then only under its old name.
    (checkpoints / ".3.tmp-k1ll3d").mkdir()
    (checkpoints / ".3.tmp-k1ll3d" / "config.json").write_text("{")
    (checkpoints / ".0.deleting-0f").mkdir()
    (checkpoints / "2").rename(checkpoints / f".2.old-{uuid.uuid4().hex}")
    shutil.copytree(checkpoints / "1", checkpoints / f".1.old-{uuid.uuid4().hex}")  # and stale
    backend, model = await _register(tiny_model_dir, tmp_path)
    assert model.step == 2 and _same(weights_of(backend, model), weights[2])
    assert sorted(p.name for p in checkpoints.iterdir()) == ["1", "2"]
    assert is_complete_checkpoint(checkpoints / "2")
    await backend.close()


class _LatestOnly:
    """A plugin backend that registers from wherever it likes and knows no resume_step."""

    async def register(self, model: TrainableModel) -> None:
        model.attach(self, Path("."), 0)  # type: ignore[arg-type]


async def test_a_backend_that_ignores_resume_step_is_an_error() -> None:
    model = TrainableModel(name="m", project="p", base_model="unused", report_metrics=[])
    with pytest.raises(ValueError, match=r"_LatestOnly cannot resume model 'm' from a chosen"):
        await model.register(_LatestOnly(), resume_step=3)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="not registered"):
        model.backend  # noqa: B018 - detached again
