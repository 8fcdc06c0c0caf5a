"""The model lifecycle every backend shares (`backends.client_models`), run against each.

A failed step leaves the last good state and its retry is the step an uninterrupted run takes;
a damaged latest checkpoint is an error naming `resume_step`, the explicit way past it; a chosen
`resume_step` resumes that checkpoint and sets the later ones aside; debris of an interrupted
write is cleaned up quietly. LocalBackend and RayBackend keep step directories, TinkerBackend
records `tinker://` checkpoints in `checkpoints.jsonl` (backend_kinds.py says how each model's
state is compared). The scenarios about the index alone (damage, debris) run on LocalBackend,
not again on RayBackend, whose checkpoints are the same directories; the failed step and
`resume_step` run on all three.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from backend_kinds import (
    MakeBackend,
    State,
    indexed_steps,
    is_loaded,
    model_id,
    same,
    state_of,
    tiny,
)
from serve_helpers import ServerProcess  # pyright: ignore[reportMissingImports]

from local_groups import synthetic_groups
from posttrain.backends.model import TrainableModel
from posttrain.backends.protocol import TrainableBackend
from posttrain.backends.resume import DamagedCheckpointError
from posttrain.engine.checkpoint import MANIFEST, is_complete_checkpoint

ADAPTER = "adapter_model.safetensors"
LR = 1e-2
# The scenarios of the index alone: RayBackend keeps the same step directories as LocalBackend.
LOCAL_AND_TINKER = ["local", pytest.param("tinker", marks=pytest.mark.slow)]


async def registered(
    make_backend: MakeBackend, path: Path, base: Path, resume_step: int | None = None
) -> tuple[TrainableBackend, TrainableModel]:
    backend = make_backend(path)
    model = tiny("m", base)
    await model.register(backend, resume_step=resume_step)
    return backend, model


async def trained(kind: str, make_backend: MakeBackend, path: Path, base: Path, steps: int):
    """Train `steps` steps, every checkpoint kept; the state after each step (0: initial)."""
    backend, model = await registered(make_backend, path, base)
    states = [await state_of(kind, backend, model)]
    for step in range(steps):
        await backend.train(model, synthetic_groups(step), learning_rate=LR)
        states.append(await state_of(kind, backend, model))
    await backend.close()
    return states


async def test_a_failed_step_leaves_the_last_good_state(
    kind: str, make_backend: MakeBackend, server_of: ServerProcess | None, tiny_model_dir, tmp_path
):
    """Ways a step fails after its updates: its checkpoint cannot be written where it goes (a
    stray directory there), or its trainer state is not JSON. Each time the step, the
    checkpoints and the weights stay those of the last good step, the step's plot is removed,
    and the retried step is the one an uninterrupted run takes."""
    straight = await trained(kind, make_backend, tmp_path / "straight", tiny_model_dir, steps=2)
    backend, model = await registered(make_backend, tmp_path / "failing", tiny_model_dir)
    await backend.train(model, synthetic_groups(0), learning_rate=LR)
    stray = model.directory / "checkpoints" / "2"  # where step 2's checkpoint goes, as a directory

    def not_finite() -> None:
        model.run_state["cursor"] = float("nan")

    def not_json() -> None:
        model.run_state["cursor"] = object()  # pyright: ignore[reportArgumentType]

    def stray_directory() -> None:
        stray.mkdir()
        (stray / "notes.txt").write_text("not a checkpoint")

    failures: list[tuple[Callable[[], None], type[Exception], str]] = [
        (not_finite, ValueError, "JSON-serialisable"),
        (not_json, TypeError, "JSON serial")  # the type json gives, as before
        if kind == "tinker"
        else (stray_directory, ValueError, "refusing to replace"),  # step directories only
    ]
    plots = {"plot_tensors": True} if kind != "tinker" else {}  # TinkerBackend has no plots
    for fail, error, match in failures:
        failed_model = model_id(backend, model) if kind == "tinker" else ""
        fail()
        with pytest.raises(error, match=match):
            await backend.train(model, synthetic_groups(1), learning_rate=LR, **plots)  # pyright: ignore[reportArgumentType]
        assert model.step == 1 and indexed_steps(kind, model) == [1]
        assert same(kind, await state_of(kind, backend, model), straight[1])
        assert not (model.directory / "plots" / "step_00002.png").exists()
        if kind == "tinker":  # the model reloaded from the checkpoint is a new one, the old freed
            assert server_of is not None and model_id(backend, model) != failed_model
            assert not is_loaded(server_of, failed_model)
        else:  # no temporary directory left, and the stray one untouched
            names = sorted(p.name for p in (model.directory / "checkpoints").iterdir())
            assert names == (["1", "2"] if stray.exists() else ["1"])
            if stray.exists():
                assert (stray / "notes.txt").read_text() == "not a checkpoint"
                shutil.rmtree(stray)
        model.run_state.pop("cursor", None)

    result = await backend.train(model, synthetic_groups(1), learning_rate=LR)
    assert result.step == model.step == 2
    assert same(kind, await state_of(kind, backend, model), straight[2])
    await backend.close()


def _delete_adapter(checkpoint: Path) -> None:
    (checkpoint / ADAPTER).unlink()


def _truncate_weights(checkpoint: Path) -> None:
    os.truncate(checkpoint / ADAPTER, (checkpoint / ADAPTER).stat().st_size // 2)


def _drop_manifest(checkpoint: Path) -> None:
    (checkpoint / MANIFEST).unlink()  # a half-written step directory, not a hidden .tmp- one


def _garble_record(index: Path) -> None:
    """The last line of the index replaced by bytes that are no record (but a whole line)."""
    lines = index.read_text().splitlines()
    index.write_text("".join(line + "\n" for line in lines[:-1]) + lines[-1][:25] + "\x00\n")


DAMAGE = {
    "deleted adapter": (_delete_adapter, f"missing {ADAPTER}"),
    "truncated weights": (_truncate_weights, f"size differs from {MANIFEST} for {ADAPTER}"),
    "no manifest": (_drop_manifest, f"{MANIFEST} is missing"),
    "garbled record": (_garble_record, "not a checkpoint record"),
}


def damage_latest(kind: str, directory: Path, damage: str) -> tuple[str, str]:
    """Damage the latest checkpoint (of step 2, the second); what the error names, and why."""
    harm, why = DAMAGE[damage]
    if kind == "tinker":
        harm(directory / "checkpoints.jsonl")
        index = directory / "checkpoints.jsonl"
        return f"latest checkpoint record (line 2 of {index}) is damaged", why
    harm(directory / "checkpoints" / "2")
    return f"latest checkpoint {directory / 'checkpoints' / '2'} is damaged", why


def set_aside(kind: str, directory: Path, resume_step: int) -> list[str]:
    """What was set aside after `resume_step`: step directory names, or raw index lines."""
    if kind == "tinker":
        (aside,) = directory.glob(f"checkpoints.set-aside-after-step-{resume_step}-*.jsonl")
        return aside.read_text().splitlines()
    (aside,) = (directory / "checkpoints").glob(f"set-aside-after-step-{resume_step}-*")
    return sorted(p.name for p in aside.iterdir())


@pytest.mark.parametrize(
    "kind, damage",
    [("local", d) for d in ("deleted adapter", "truncated weights", "no manifest")]
    + [pytest.param("tinker", "garbled record", marks=pytest.mark.slow)],
    indirect=["kind"],
)
async def test_a_damaged_latest_checkpoint_is_an_error_naming_it_and_the_way_out(
    kind: str, make_backend: MakeBackend, tiny_model_dir, tmp_path, damage: str
):
    states = await trained(kind, make_backend, tmp_path, tiny_model_dir, steps=2)
    directory = tmp_path / "p" / "models" / "m"
    named, why = damage_latest(kind, directory, damage)
    backend = make_backend(tmp_path)
    model = tiny("m", tiny_model_dir)
    with pytest.raises(DamagedCheckpointError) as caught:
        await model.register(backend)
    message = str(caught.value)
    assert named in message and why in message
    assert "resume_step=1" in message and "--resume-step 1" in message
    assert model.step == 0 and model.run_state == {}  # not registered, nothing resumed
    with pytest.raises(RuntimeError, match="not registered"):
        backend.client(model)  # pyright: ignore[reportAttributeAccessIssue]

    # The way out it names: step 1, exactly; step 2 is moved aside, whole, not deleted.
    await model.register(backend, resume_step=1)
    assert model.step == 1 and same(kind, await state_of(kind, backend, model), states[1])
    assert indexed_steps(kind, model) == [1]
    if kind == "tinker":
        [line] = set_aside(kind, directory, 1)
        assert line.endswith("\x00")  # the damaged record, kept
    else:
        assert set_aside(kind, directory, 1) == ["2"]
    # Training goes on from there, and the next registration resumes it without a word.
    await backend.train(model, synthetic_groups(1), learning_rate=LR)
    retrained = await state_of(kind, backend, model)
    await backend.close()
    backend, model = await registered(make_backend, tmp_path, tiny_model_dir)
    assert model.step == 2 and same(kind, await state_of(kind, backend, model), retrained)
    # Same data, same start, same kernels: the step is redone (bit for bit in this process).
    assert same(kind, retrained, states[2])
    await backend.close()


def damage_only(kind: str, directory: Path) -> str:
    """Damage the only checkpoint (of step 1); what is then set aside."""
    if kind == "tinker":
        _garble_record(directory / "checkpoints.jsonl")
        return (directory / "checkpoints.jsonl").read_text().splitlines()[0]
    _delete_adapter(directory / "checkpoints" / "1")
    return "1"


@pytest.mark.parametrize("kind", LOCAL_AND_TINKER, indirect=True)
async def test_a_damaged_only_checkpoint_never_falls_back_to_the_base_model_silently(
    kind: str, make_backend: MakeBackend, tiny_model_dir, tmp_path
):
    states = await trained(kind, make_backend, tmp_path, tiny_model_dir, steps=1)
    directory = tmp_path / "p" / "models" / "m"
    damaged = damage_only(kind, directory)
    with pytest.raises(DamagedCheckpointError, match=r"start again from the base model") as caught:
        await registered(make_backend, tmp_path, tiny_model_dir)
    assert "resume_step=0" in str(caught.value)
    backend, model = await registered(make_backend, tmp_path, tiny_model_dir, resume_step=0)
    assert model.step == 0 and same(kind, await state_of(kind, backend, model), states[0])
    assert indexed_steps(kind, model) == [] and set_aside(kind, directory, 0) == [damaged]
    await backend.close()


async def test_resume_step_resumes_a_chosen_checkpoint_and_sets_later_ones_aside(
    kind: str, make_backend: MakeBackend, tiny_model_dir, tmp_path
):
    backend, model = await registered(make_backend, tmp_path, tiny_model_dir)
    states: list[State] = []
    for step in range(3):
        if step:
            model.run_state = {"cursor": step}
        await backend.train(model, synthetic_groups(step), learning_rate=LR)
        states.append(await state_of(kind, backend, model))
    await backend.close()

    backend = make_backend(tmp_path)
    resumed = tiny("m", tiny_model_dir)
    if kind == "tinker":
        refused = r"resume_step=7: .*no checkpoint of that step.*\[1, 2, 3\]"
    else:
        refused = r"resume_step=7: no checkpoint at .*Complete checkpoints in .*\['1', '2', '3'\]"
    with pytest.raises(ValueError, match=refused):
        await resumed.register(backend, resume_step=7)
    await resumed.register(backend, resume_step=1)
    assert resumed.step == 1 and resumed.run_state == {}  # run_state as saved with step 1
    assert same(kind, await state_of(kind, backend, resumed), states[0])
    assert indexed_steps(kind, resumed) == [1]
    aside = set_aside(kind, resumed.directory, 1)
    steps = [json.loads(line)["step"] for line in aside] if kind == "tinker" else aside
    assert steps == ([2, 3] if kind == "tinker" else ["2", "3"])
    result = await backend.train(resumed, synthetic_groups(5), learning_rate=LR)
    assert result.step == 2 and indexed_steps(kind, resumed) == [1, 2]
    await backend.close()


@pytest.mark.parametrize("kind", ["local"], indirect=True)
async def test_resume_step_must_name_a_complete_checkpoint(
    kind: str, make_backend: MakeBackend, tiny_model_dir: Path, tmp_path: Path
):
    await trained(kind, make_backend, tmp_path, tiny_model_dir, steps=2)
    checkpoints = tmp_path / "p" / "models" / "m" / "checkpoints"
    _delete_adapter(checkpoints / "1")
    for step, problem in ((5, "no checkpoint at"), (1, f"missing {ADAPTER}")):
        with pytest.raises(ValueError, match=problem) as caught:
            await registered(make_backend, tmp_path, tiny_model_dir, resume_step=step)
        assert "Complete checkpoints in" in str(caught.value) and "['2']" in str(caught.value)
    with pytest.raises(ValueError, match="resume_step must be a step number >= 0"):
        await registered(make_backend, tmp_path, tiny_model_dir, resume_step=-1)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["1", "2"]  # nothing moved


def interrupt_writes(kind: str, directory: Path) -> None:
    """What kills mid-write leave. Step directories: a kill mid-write of step 3, mid-prune of
    step 0, and between the two renames that replace step 2 (where there is no atomic
    exchange): step 2 is then only under its old name. The index: a record cut short."""
    if kind == "tinker":
        with open(directory / "checkpoints.jsonl", "a") as f:
            f.write('{"step": 3, "path": "tinker://')
        return
    checkpoints = directory / "checkpoints"
    (checkpoints / ".3.tmp-k1ll3d").mkdir()
    (checkpoints / ".3.tmp-k1ll3d" / "config.json").write_text("{")
    (checkpoints / ".0.deleting-0f").mkdir()
    (checkpoints / "2").rename(checkpoints / f".2.old-{uuid.uuid4().hex}")
    shutil.copytree(checkpoints / "1", checkpoints / f".1.old-{uuid.uuid4().hex}")  # and stale


@pytest.mark.parametrize("kind", LOCAL_AND_TINKER, indirect=True)
async def test_debris_of_an_interrupted_write_is_cleaned_quietly(
    kind: str, make_backend: MakeBackend, tiny_model_dir: Path, tmp_path: Path
):
    """And a checkpoint taken again at the same step resumes with the trainer state it saved
    last (the index has two records of that step; the directory, the newer files)."""
    states = await trained(kind, make_backend, tmp_path, tiny_model_dir, steps=2)
    backend, model = await registered(make_backend, tmp_path, tiny_model_dir)
    model.run_state = {"cursor": 9}
    await backend.checkpoint(model)  # pyright: ignore[reportAttributeAccessIssue]
    await backend.close()
    directory = tmp_path / "p" / "models" / "m"
    interrupt_writes(kind, directory)
    backend, model = await registered(make_backend, tmp_path, tiny_model_dir)
    assert model.step == 2 and model.run_state == {"cursor": 9}
    assert same(kind, await state_of(kind, backend, model), states[2])
    if kind == "tinker":  # the cut record is gone, so the next one starts a line of its own
        assert indexed_steps(kind, model) == [1, 2, 2]
    else:
        assert sorted(p.name for p in (directory / "checkpoints").iterdir()) == ["1", "2"]
        assert is_complete_checkpoint(directory / "checkpoints" / "2")
    await backend.train(model, synthetic_groups(2), learning_rate=LR)
    assert sorted(set(indexed_steps(kind, model))) == [1, 2, 3]
    await backend.close()


class _LatestOnly:
    """A plugin backend that registers from wherever it likes and knows no resume_step."""

    async def register(self, model: TrainableModel) -> None:
        model.attach(self, Path("."), 0)  # pyright: ignore[reportArgumentType]


async def test_a_backend_that_ignores_resume_step_is_an_error() -> None:
    model = TrainableModel(
        name="m", project="p", base_model="unused", report_metrics=[], lora_rank=8
    )
    with pytest.raises(ValueError, match=r"_LatestOnly cannot resume model 'm' from a chosen"):
        await model.register(_LatestOnly(), resume_step=3)  # pyright: ignore[reportArgumentType]
    with pytest.raises(RuntimeError, match="not registered"):
        model.backend  # noqa: B018 - detached again
