"""A save killed at any point never loses the last good checkpoint.

Each trial forks a child that saves with every file-system operation the save uses wrapped by
a counter; at the k-th operation the child dies (`os._exit`, no cleanup, as under SIGKILL),
either before the operation or, for an operation that writes a file, after writing half of
it. The parent then looks the checkpoint up through the public functions (which recover what
the kill left) and requires the old or the new checkpoint, complete, with exactly its
weights. k runs from 1 until a save completes without reaching k, for every kind of save:
new or overwrite, full or LoRA, with and without optimizer, and sampler weights; overwrites
run with the atomic exchange and with the two-rename fallback used where there is none.
Every file is written inside the hidden temporary directory, the same way whatever the save
replaces, so the torn writes run once per model and save kind (in the exchange overwrite).
"""

from __future__ import annotations

import builtins
import io
import os
import shutil
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import peft.peft_model
import pytest
import safetensors.torch
import torch
import transformers.modeling_utils

from posttrain.engine import atomic_replace
from posttrain.engine.checkpoint import (
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    save_weights,
)
from posttrain.engine.optim import create_adamw_optimizer
from posttrain.engine.resume_state import rng_state, set_rng_state
from posttrain.models.load import LoraSettings, apply_lora, load_hf_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(os, "fork"), reason="kills a forked child"),
]
# Child exit codes; KILLED_WRITING: killed before an operation that writes a file.
COMPLETED, KILLED, KILLED_WRITING, CRASHED = 0, 17, 19, 18
LORA = LoraSettings(rank=2, alpha=4, train_attn=True, train_mlp=True, train_unembed=False)
# Every operation a save performs on files, by (module, attribute). The torch and safetensors
# writers run in C++ and Rust, so they count whole; Python file writes count per open.
OPERATIONS: list[tuple[types.ModuleType, str]] = [
    *[(os, name) for name in ("rename", "replace", "open", "fsync", "mkdir", "rmdir", "unlink")],
    (builtins, "open"),
    (io, "open"),
    (shutil, "rmtree"),
    (torch, "save"),
    (safetensors.torch, "save_file"),
    (transformers.modeling_utils, "safe_save_file"),
    (peft.peft_model, "safe_save_file"),
    (atomic_replace, "_exchange"),
]
# Of those, the ones that write a file at a path they are given, and which argument it is.
FILE_WRITERS = {
    "torch.save": 1,
    "safetensors.torch.save_file": 1,
    "transformers.modeling_utils.safe_save_file": 1,
    "peft.peft_model.safe_save_file": 1,
}


@dataclass
class Version:
    """One saved state of a model: its weights and the tag in its trainer_state."""

    tag: str
    weights: dict[str, torch.Tensor]


@dataclass
class Kind:
    model: str  # "full" or "lora"
    save: str  # "state+optimizer", "state", "sampler"
    overwrite: bool
    exchange: bool  # whether the atomic exchange is available

    @property
    def name(self) -> str:
        target = "overwrite" if self.overwrite else "new"
        via = ("/exchange" if self.exchange else "/renames") if self.overwrite else ""
        return f"{self.model} {self.save} {target}{via}"

    @property
    def checkpoint_name(self) -> str:
        return "openai" if self.save == "sampler" else "7"


KINDS = [
    Kind(model, save, overwrite, exchange)
    for model in ("full", "lora")
    for save in ("state+optimizer", "state", "sampler")
    for overwrite, exchange in ((False, True), (True, True), (True, False))
]


def _build(base: Path, kind: str, seed: int):
    """A model trained one AdamW step from `seed` (so its optimizer has moments)."""
    torch.manual_seed(seed)
    model = load_hf_model(base)
    if kind == "lora":
        model = apply_lora(model, LORA)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = create_adamw_optimizer(params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8)
    ids_BT = torch.randint(0, 256, (1, 8))
    model(input_ids=ids_BT, labels=ids_BT).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def _trained(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _save(kind: Kind, path: Path, model, optimizer, tag: str) -> None:
    if kind.save == "sampler":
        save_weights(path, model)
    else:
        with_optimizer = optimizer if kind.save == "state+optimizer" else None
        save_checkpoint(path, model=model, optimizer=with_optimizer, trainer_state={"tag": tag})


class _Killer:
    """Wraps OPERATIONS; dies at operation `kill_at` (torn: after half a file is written).

    `writes` records, per operation, whether it writes a file (where a torn write can happen).
    """

    def __init__(self, kill_at: int, torn: bool) -> None:
        self.count, self.kill_at, self.torn = 0, kill_at, torn
        self.writes: list[bool] = []

    def install(self) -> None:
        for module, attribute in OPERATIONS:
            name = f"{module.__name__}.{attribute}"
            setattr(module, attribute, self._wrap(name, getattr(module, attribute)))

    def _wrap(self, name: str, real: Callable) -> Callable:
        def operation(*args, **kwargs):
            self.count += 1
            self.writes.append(_writes(name, args, kwargs))
            if self.count != self.kill_at:
                return real(*args, **kwargs)
            if not self.torn:
                os._exit(KILLED_WRITING if self.writes[-1] else KILLED)
            if name in FILE_WRITERS:
                real(*args, **kwargs)
                target = Path(args[FILE_WRITERS[name]])
                size = target.stat().st_size
                os.truncate(target, size // 2)
                os._exit(KILLED)
            return _TornFile(real(*args, **kwargs))  # an open for writing (see _writes)

        return operation


class _TornFile:
    """A file whose first write stops halfway, then the process dies."""

    def __init__(self, file) -> None:
        self._file = file

    def write(self, data):
        self._file.write(data[: len(data) // 2])
        self._file.flush()
        os._exit(KILLED)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()

    def __getattr__(self, name: str):
        return getattr(self._file, name)


def _writes(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether an operation writes a file (a torn write is then a second way to die)."""
    if name in FILE_WRITERS:
        return True
    if name in ("builtins.open", "io.open") and args and not isinstance(args[0], int):
        mode = args[1] if len(args) > 1 else kwargs.get("mode", "r")
        return isinstance(mode, str) and any(c in mode for c in "wax+")
    return False


def _run_child(kind: Kind, path: Path, model, optimizer, kill_at: int, torn: bool) -> int:
    """Fork; the child saves the "new" version with the killer installed; its exit code."""
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = CRASHED
        try:
            if not kind.exchange:
                atomic_replace._exchange = lambda a, b: False
            _Killer(kill_at, torn).install()
            _save(kind, path, model, optimizer, "new")
            code = COMPLETED
        except BaseException as exc:  # report and die, never return to pytest
            sys.stderr.write(f"child failed at operation {kill_at}: {exc!r}\n")
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _verify(kind: Kind, root: Path, probe, probe_optimizer, versions: list[Version]) -> str:
    """Look the checkpoint up as a user would; which version it is, or what is wrong."""
    path = root / kind.checkpoint_name
    listed = list_checkpoints(root)  # recovers, as load does
    if kind.save != "sampler" and listed not in ([], [path]):
        return f"listing {listed}"
    for p in probe.parameters():
        if p.requires_grad:
            p.data.fill_(float("nan"))  # a weight the load does not set fails the comparison
    saved_rng = rng_state()
    try:
        state = load_checkpoint(
            path,
            model=probe,
            optimizer=probe_optimizer if kind.save == "state+optimizer" else None,
            restore_rng=kind.save != "sampler",
        )
    except FileNotFoundError:
        if kind.overwrite:
            return "the old checkpoint is gone"
        return "none" if listed == [] else "listed but not loadable"
    except ValueError as exc:
        return f"load failed: {exc}"
    finally:
        set_rng_state(saved_rng)
    got = _trained(probe)
    for version in versions:
        if all(torch.equal(got[n], w) for n, w in version.weights.items()):
            if kind.save != "sampler" and state.get("tag") != version.tag:
                return f"weights of {version.tag}, trainer_state of {state.get('tag')}"
            return version.tag
    return "weights match neither version"


def _trials(kind: Kind, models: list[tuple], work: Path) -> dict[str, int]:
    """Every kill point of one kind of save; counts by outcome (failures by message)."""
    (old_model, old_optimizer), (new_model, new_optimizer), (probe, probe_optimizer) = models
    versions = [Version("new", _trained(new_model))]
    pristine = work / "pristine"
    pristine.mkdir(parents=True)
    if kind.overwrite:
        _save(kind, pristine / kind.checkpoint_name, old_model, old_optimizer, "old")
        versions.append(Version("old", _trained(old_model)))
    outcomes: dict[str, int] = {}

    def trial(k: int, torn: bool) -> int:
        root = work / f"{k}-{torn}"
        shutil.copytree(pristine, root)  # the same operations in every trial
        path = root / kind.checkpoint_name
        code = _run_child(kind, path, new_model, new_optimizer, k, torn)
        if code == COMPLETED:
            return code
        if code not in (KILLED, KILLED_WRITING):
            outcome = f"child exit {code} at {k}"
        else:
            outcome = _verify(kind, root, probe, probe_optimizer, versions)
        # Looking the name up put any old copy back or deleted it. What remains is a hidden
        # `.NAME.tmp-*` at most, which the next save of the name deletes (tested apart).
        leftovers = [p.name for p in root.iterdir() if p.name != kind.checkpoint_name]
        if outcome in ("old", "new", "none") and any(".tmp-" not in n for n in leftovers):
            outcome = f"leftovers {sorted(leftovers)}"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        shutil.rmtree(root)
        return code

    k = 1
    while (code := trial(k, torn=False)) != COMPLETED:
        if code == KILLED_WRITING and kind.overwrite and kind.exchange:
            trial(k, torn=True)
        k += 1
    return outcomes


@pytest.mark.parametrize("model_kind", ["full", "lora"])
def test_a_killed_save_never_loses_the_last_good_checkpoint(
    model_kind: str, tiny_model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    # A kill, unlike a power cut, keeps what the page cache holds: fsync only slows the trials.
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    models = [_build(tiny_model_dir, model_kind, seed) for seed in (1, 2, 3)]  # old, new, probe
    report: list[str] = []
    failures: list[str] = []
    for i, kind in enumerate(k for k in KINDS if k.model == model_kind):
        outcomes = _trials(kind, models, tmp_path / str(i))
        trials = sum(outcomes.values())
        good = sum(n for outcome, n in outcomes.items() if outcome in ("old", "new", "none"))
        report.append(f"{kind.name}: {good}/{trials} trials passed {outcomes}")
        if good != trials:
            failures.append(report[-1])
    print("\n" + "\n".join(report))  # the numbers, with `pytest -s`
    assert not failures, "\n".join(failures)
