"""Checkpoints: PEFT adapter or full safetensors weights, plus optimizer, RNG and trainer state.

A checkpoint is a directory. It is written to a temporary sibling, fsynced and put in place by
`atomic_replace`, so its path always holds a complete checkpoint, the old one or the new one,
even when the writer is killed while replacing it; every function here that reads or lists
checkpoints first undoes what such a kill left (`atomic_replace.recover`). `checkpoint.json`,
written last, lists every file with its size: a directory without it, or missing a file it
lists, is incomplete and loading it is an error, never a silent fresh start.

A LoRA checkpoint holds exactly what `PeftModel.save_pretrained` writes (`adapter_config.json`,
`adapter_model.safetensors`), so PEFT and vLLM load it as-is; a full one holds what
`PreTrainedModel.save_pretrained` writes (`config.json`, safetensors weights).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Literal, TypeAlias, get_args

import torch
from peft import PeftModel, PeftType
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file
from torch import nn
from transformers import PreTrainedModel

from posttrain.engine import atomic_replace
from posttrain.engine.atomic_replace import name_lock
from posttrain.engine.resume_state import (
    optimizer_state_by_index,
    optimizer_state_by_name,
    rng_state,
    set_rng_state,
)
from posttrain.models.file_modes import apply_umask, apply_umask_to_weights

JSONValue: TypeAlias = str | int | float | bool | list["JSONValue"] | dict[str, "JSONValue"] | None
CheckpointKind = Literal["lora", "full"]

FORMAT_VERSION = 1
MANIFEST = "checkpoint.json"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng_state.pt"
TRAINER_STATE_FILE = "trainer_state.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_REQUIRED: dict[CheckpointKind, tuple[str, ...]] = {
    "lora": (ADAPTER_CONFIG, ADAPTER_WEIGHTS),
    "full": ("config.json",),
}
# A step checkpoint's name, and the old copy an interrupted replacement of it leaves.
_STEP = re.compile(r"[0-9]+")
_OLD_STEP = re.compile(r"\.([0-9]+)\.old-[0-9a-f]{32}")
# adapter_config.json fields that change which weights exist or how they are applied.
_LORA_FIELDS = (
    *("peft_type", "r", "lora_alpha", "target_modules", "exclude_modules", "modules_to_save"),
    *("layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern", "bias"),
    *("use_rslora", "use_dora", "fan_in_fan_out", "trainable_token_indices"),
)


@dataclass(frozen=True)
class _Manifest:
    kind: CheckpointKind
    files: dict[str, int]  # relative path -> size in bytes
    optimizer: bool
    rng: bool


def save_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    trainer_state: Mapping[str, JSONValue] | None = None,
    include_rng: bool = True,
) -> Path:
    """Write weights (adapter or full), optimizer, RNG and trainer state atomically to `path`.

    An existing checkpoint at `path` is replaced; any other existing directory is refused.
    """
    final = Path(path)
    kind = _model_kind(model)
    # Everything that can be refused is checked before the first byte is written.
    state_text = _encode_trainer_state(trainer_state)
    optim_state = optimizer_state_by_name(model, optimizer) if optimizer is not None else None
    with name_lock(final):
        _recover(final)
        # What an earlier writer of this name left when killed (this process's own saves in
        # progress excepted).
        atomic_replace.remove_debris(final.parent, lambda name: name == final.name)
        _check_replaceable(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    apply_umask(tmp)  # not mkdtemp's 0700: a checkpoint is read like any other directory
    with atomic_replace.writing(tmp):
        try:
            _write_weights(tmp, model)
            if optim_state is not None:
                torch.save(optim_state, tmp / OPTIMIZER_FILE)
            if include_rng:
                torch.save(rng_state(), tmp / RNG_FILE)
            (tmp / TRAINER_STATE_FILE).write_text(state_text)
            _write_manifest(tmp, kind, optimizer=optim_state is not None, rng=include_rng)
            with name_lock(final):
                _check_replaceable(final)  # again: another thread may have written meanwhile
                atomic_replace.publish(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def save_weights(path: str | Path, model: nn.Module) -> Path:
    """Weights only (for a sampler): the same atomic checkpoint without optimizer or RNG state."""
    return save_checkpoint(path, model=model, include_rng=False)


def load_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    restore_rng: bool = True,
) -> dict[str, JSONValue]:
    """Restore weights in place, optimizer state (if given) and RNG; return the trainer state."""
    root = Path(path)
    with name_lock(root):  # no save of this name swaps the files while they are read
        _recover(root)
        return _load(root, model, optimizer, restore_rng)


def _load(
    root: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    restore_rng: bool,
) -> dict[str, JSONValue]:
    manifest = _read_manifest(root)
    kind = _model_kind(model)
    if manifest.kind != kind:
        held = "a LoRA adapter" if manifest.kind == "lora" else "full model weights"
        ours = "a LoRA PeftModel" if kind == "lora" else "a full model without an adapter"
        raise ValueError(
            f"checkpoint at {root} holds {held} but the model is {ours}; "
            "load it into a matching model"
        )
    if optimizer is not None and not manifest.optimizer:
        raise ValueError(
            f"checkpoint at {root} has no optimizer state ({OPTIMIZER_FILE}); "
            "load it without an optimizer (with_optimizer=False) or pick another checkpoint"
        )
    if restore_rng and not manifest.rng:
        raise ValueError(
            f"checkpoint at {root} has no RNG state ({RNG_FILE}); load it with restore_rng=False"
        )
    # Read and check everything before touching the model, so a refusal leaves it untouched.
    trainer_state = _read_trainer_state(root)
    optim_state = None
    if optimizer is not None:
        saved = torch.load(root / OPTIMIZER_FILE, weights_only=True)
        optim_state = optimizer_state_by_index(model, optimizer, saved, source=root)
    rng = torch.load(root / RNG_FILE, weights_only=True) if restore_rng else None
    if isinstance(model, PeftModel):
        _load_adapter(root, model)
    elif isinstance(model, PreTrainedModel):
        _load_full(root, model, manifest)
    if optimizer is not None and optim_state is not None:
        optimizer.load_state_dict(optim_state)
    if rng is not None:
        set_rng_state(rng)
    return trainer_state


def checkpoint_kind(path: str | Path) -> CheckpointKind:
    """The kind ("lora" or "full") recorded in a complete checkpoint's manifest."""
    root = Path(path)
    with name_lock(root):
        _recover(root)
        return _read_manifest(root).kind


def is_complete_checkpoint(path: str | Path) -> bool:
    """True when `path` has a manifest and every file it lists, at the listed size (after
    putting back the old copy an interrupted replacement left, as every reader does)."""
    return checkpoint_problem(path) is None


def checkpoint_problem(path: str | Path) -> str | None:
    """What makes `path` not a complete checkpoint (missing, incomplete, corrupt), or None."""
    root = Path(path)
    with name_lock(root):
        _recover(root)
        try:
            _read_manifest(root)
        except (FileNotFoundError, ValueError) as exc:
            return str(exc)
    return None


def step_directories(directory: str | Path) -> list[Path]:
    """Every directory in `directory` named by an integer step, complete or not, oldest first.

    Recovers first, so a step whose replacement was interrupted is listed under its name.
    """
    root = Path(directory)
    if not root.is_dir():
        return []
    names = [p.name for p in root.iterdir()]
    interrupted = {m.group(1) for name in names if (m := _OLD_STEP.fullmatch(name))}
    for step in interrupted:
        with name_lock(root / step):
            _recover(root / step)
    steps = interrupted | {name for name in names if _STEP.fullmatch(name)}
    found = [root / step for step in steps if (root / step).is_dir()]
    return sorted(found, key=lambda p: int(p.name))


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoints in `directory` named by integer step, oldest first."""
    return [p for p in step_directories(directory) if _is_complete(p)]


def prune_checkpoints(directory: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete step checkpoints; return what was deleted.

    Also removes what a killed process left behind: half-written `.N.tmp-*` directories and
    half-deleted `.N.deleting-*` ones (only the one writer of `directory` calls this).
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (the newest is never deleted), got {keep_last}")
    root = Path(directory)
    doomed = list_checkpoints(root)[:-keep_last]  # recovers interrupted replacements first
    remove_step_debris(root)
    for old in doomed:
        delete_checkpoint(old)
    return doomed


def delete_checkpoint(path: Path) -> None:
    """Delete one step checkpoint. Renamed first, so a crash mid-delete leaves a hidden
    directory (debris `remove_step_debris` clears), not a half checkpoint."""
    with name_lock(path):
        hidden = path.with_name(f".{path.name}.deleting-{uuid.uuid4().hex}")
        path.rename(hidden)
    shutil.rmtree(hidden)


def remove_step_debris(directory: str | Path) -> None:
    """Delete the hidden `.N.tmp-*` and `.N.deleting-*` directories that killed writes and
    deletions of step checkpoints left in `directory` (call as its one writer)."""
    atomic_replace.remove_debris(Path(directory), lambda name: _STEP.fullmatch(name) is not None)


def _recover(root: Path) -> None:
    atomic_replace.recover(root, _is_complete)


def _is_complete(root: Path) -> bool:
    try:
        _read_manifest(root)
    except (FileNotFoundError, ValueError):
        return False
    return True


def _adapter_name(model: PeftModel) -> str:
    return next(iter(model.peft_config))


def _model_kind(model: nn.Module) -> CheckpointKind:
    if isinstance(model, PeftModel):
        if len(model.peft_config) != 1:
            raise ValueError(
                f"model must have exactly one adapter to checkpoint, got {sorted(model.peft_config)}"
            )
        peft_type = model.peft_config[_adapter_name(model)].peft_type
        if peft_type != PeftType.LORA:
            raise ValueError(f"model's adapter must be LoRA, got {peft_type}")
        return "lora"
    if isinstance(model, PreTrainedModel):
        return "full"
    raise ValueError(f"model must be a PeftModel or a PreTrainedModel, got {type(model).__name__}")


def _encode_trainer_state(trainer_state: Mapping[str, JSONValue] | None) -> str:
    state = dict(trainer_state or {})
    if "format_version" in state:
        raise ValueError("trainer_state must not use the reserved key 'format_version'")
    try:
        return json.dumps({"format_version": FORMAT_VERSION, **state}, indent=2, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"trainer_state must be JSON-serialisable (finite numbers): {err}"
        ) from err


def _read_trainer_state(root: Path) -> dict[str, JSONValue]:
    state = json.loads((root / TRAINER_STATE_FILE).read_text())
    if not isinstance(state, dict):
        raise ValueError(f"{root / TRAINER_STATE_FILE} must hold a JSON object")
    state.pop("format_version", None)
    return state


def _check_replaceable(final: Path) -> None:
    """Refuse to replace anything but a previous checkpoint (or an empty directory)."""
    if not final.exists():
        return
    if not final.is_dir():
        raise ValueError(f"checkpoint path {final} exists and is not a directory")
    if not (final / MANIFEST).is_file() and any(final.iterdir()):
        raise ValueError(
            f"checkpoint path {final} is a non-empty directory without {MANIFEST}; "
            "refusing to replace something that is not a checkpoint"
        )


def _write_weights(tmp: Path, model: nn.Module) -> None:
    if not isinstance(model, PeftModel):
        assert isinstance(model, PreTrainedModel)  # _model_kind admitted it
        model.save_pretrained(str(tmp))
        apply_umask_to_weights(tmp)
        return
    name = _adapter_name(model)
    # The adapter alone: PEFT's default also saves a targeted lm_head or embedding's whole base
    # weight (for a resized vocabulary, which posttrain never makes), 272 MB of a 295 MB adapter
    # at Qwen2.5-0.5B's size; the base model has it already.
    model.save_pretrained(str(tmp), selected_adapters=[name], save_embedding_layers=False)
    if name != "default":
        # PEFT nests any adapter not named "default" in a subdirectory; a checkpoint is flat.
        for item in (tmp / name).iterdir():
            item.rename(tmp / item.name)
        (tmp / name).rmdir()
    apply_umask_to_weights(tmp)


def _fsync(path: Path) -> None:
    if path.is_dir() and os.name != "posix":
        return  # only POSIX can open and fsync a directory
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_manifest(tmp: Path, kind: CheckpointKind, *, optimizer: bool, rng: bool) -> None:
    """Fsync every file, then write the manifest last: its presence means the rest is durable."""
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    for file in files:
        _fsync(file)
    manifest = {
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "files": {p.relative_to(tmp).as_posix(): p.stat().st_size for p in files},
        "optimizer": optimizer,
        "rng": rng,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    _fsync(tmp / MANIFEST)
    _fsync(tmp)


def _read_manifest(root: Path) -> _Manifest:
    """The manifest of a complete checkpoint, or an error naming the path and what is missing."""
    if not root.exists():
        raise FileNotFoundError(f"no checkpoint at {root}")
    if not root.is_dir():
        raise ValueError(f"checkpoint path {root} is not a directory")
    if not (root / MANIFEST).is_file():
        raise ValueError(
            f"incomplete checkpoint at {root}: {MANIFEST} is missing "
            "(the save did not finish, or this is not a posttrain checkpoint)"
        )
    manifest = _parse_manifest(root / MANIFEST)
    files = manifest.files
    needed = [*_REQUIRED[manifest.kind], TRAINER_STATE_FILE]
    needed += [OPTIMIZER_FILE] * manifest.optimizer + [RNG_FILE] * manifest.rng
    if not any(name.endswith(".safetensors") for name in files):
        needed.append(ADAPTER_WEIGHTS if manifest.kind == "lora" else "model.safetensors")
    missing = {name for name in needed if name not in files}
    missing |= {name for name in files if not (root / name).is_file()}
    if missing:
        raise ValueError(f"incomplete checkpoint at {root}: missing {', '.join(sorted(missing))}")
    wrong = [name for name, size in files.items() if (root / name).stat().st_size != size]
    if wrong:
        raise ValueError(
            f"corrupt checkpoint at {root}: size differs from {MANIFEST} for {', '.join(wrong)}"
        )
    return manifest


def _parse_manifest(file: Path) -> _Manifest:
    try:
        raw = json.loads(file.read_text())
        version, kind, files = raw["format_version"], raw["kind"], raw["files"]
        optimizer, rng = bool(raw["optimizer"]), bool(raw["rng"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"corrupt manifest {file}: {err!r}") from err
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ValueError(f"{file} has format_version {version!r}; this reads <= {FORMAT_VERSION}")
    if kind not in get_args(CheckpointKind):
        raise ValueError(f"{file} has kind {kind!r}; expected 'lora' or 'full'")
    if not isinstance(files, dict):
        raise ValueError(f"corrupt manifest {file}: 'files' must map names to sizes")
    return _Manifest(kind=kind, files=files, optimizer=optimizer, rng=rng)


def _normalise(value: object) -> object:
    """Sets and lists compare as sorted lists (PEFT keeps target_modules as a set in memory)."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, set | list | tuple):
        return sorted(str(_normalise(v)) for v in value)
    return value


def _load_adapter(root: Path, model: PeftModel) -> None:
    name = _adapter_name(model)
    saved = json.loads((root / ADAPTER_CONFIG).read_text())
    current = model.peft_config[name].to_dict()
    diffs = [
        f"{key}: checkpoint {saved.get(key)!r}, model {current.get(key)!r}"
        for key in _LORA_FIELDS
        if _normalise(saved.get(key)) != _normalise(current.get(key))
    ]
    if diffs:
        raise ValueError(
            f"LoRA checkpoint at {root} does not match the model's adapter: {'; '.join(diffs)}"
        )
    weights = load_file(root / ADAPTER_WEIGHTS)
    expected = get_peft_model_state_dict(model, adapter_name=name, save_embedding_layers=False)
    _check_tensors(root / ADAPTER_WEIGHTS, weights, expected, allow_extra=True)
    result = set_peft_model_state_dict(model, weights, adapter_name=name)
    if result.unexpected_keys:
        raise ValueError(
            f"{root / ADAPTER_WEIGHTS} has weights the model lacks: {result.unexpected_keys[:5]}"
        )


def _load_full(root: Path, model: PreTrainedModel, manifest: _Manifest) -> None:
    saved_type = json.loads((root / "config.json").read_text()).get("model_type")
    if saved_type != model.config.model_type:
        raise ValueError(
            f"checkpoint at {root} is a {saved_type!r} model but the model is {model.config.model_type!r}"
        )
    weights: dict[str, torch.Tensor] = {}
    for name in sorted(manifest.files):
        if name.endswith(".safetensors"):
            weights.update(load_file(root / name))
    expected = model.state_dict()
    # save_pretrained writes a tied weight once; its twins are the same Parameter object.
    all_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    tied = all_names - {n for n, _ in model.named_parameters()}
    _check_tensors(
        root, weights, {k: v for k, v in expected.items() if k not in tied}, allow_extra=False
    )
    model.load_state_dict(weights, strict=False)


def _check_tensors(
    source: Path,
    saved: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    *,
    allow_extra: bool,
) -> None:
    """Same names (or a superset when `allow_extra`) and the same shapes, or a ValueError."""
    problems = [f"missing {k}" for k in sorted(expected.keys() - saved.keys())[:5]]
    if not allow_extra:
        problems += [f"unexpected {k}" for k in sorted(saved.keys() - expected.keys())[:5]]
    problems += [
        f"{k}: checkpoint {tuple(saved[k].shape)}, model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in saved and saved[k].shape != v.shape
    ][:5]
    if problems:
        raise ValueError(f"weights at {source} do not fit the model: {'; '.join(problems)}")
