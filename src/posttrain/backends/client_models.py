"""What every backend over a posttrain training client does the same way.

`ModelClients` keeps the models a backend registered, each with its training client, and
runs the shared trainer on them: register (or resume from the latest checkpoint), one RL or
SFT step, checkpoint with retention, close. LocalBackend and RayBackend each hold one and
differ only in how a client is made.

A step is all or nothing: the model's step advances only once its updates, plots and
checkpoint are done. If any of them fails, the step and the checkpoints stay as they were and
the client is reloaded from the checkpoint of the current step, so a retry starts from the
last good state.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Generic, TypeVar

from posttrain.backends.capabilities import Capabilities
from posttrain.backends.preflight import preflight_rl, preflight_sft
from posttrain.backends.protocol import TrainableBackend
from posttrain.backends.resume import resume_point, set_aside
from posttrain.clients.local import LocalTrainingClient
from posttrain.engine.checkpoint import is_complete_checkpoint, prune_checkpoints
from posttrain.model import RunState, TrainableModel
from posttrain.trainer.config import RLConfig, SFTConfig
from posttrain.trainer.metrics import StepMetrics
from posttrain.trainer.rl import prepare_batch, train_rl_batch
from posttrain.trainer.sft import sft_batches, train_sft_batches
from posttrain.trainer.tensor_plots import TensorRecorder
from posttrain.types import TrainResult, Trajectory, TrajectoryGroup

ClientT = TypeVar("ClientT", bound=LocalTrainingClient)
# model.json keys that must match to reuse a model directory.
IDENTITY_KEYS = ("base_model", "lora_rank")


class ModelClients(Generic[ClientT]):
    """Models under `path/<project>/models/<name>/`, each with its client and checkpoints."""

    def __init__(
        self,
        path: str | Path,
        keep_checkpoints: int,
        *,
        backend: str,
        capabilities: Capabilities,
    ) -> None:
        self.backend = backend
        self.capabilities = capabilities
        if keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {keep_checkpoints}")
        self.path = Path(path)
        self.keep_checkpoints = keep_checkpoints
        self._clients: dict[int, ClientT] = {}

    def model_dir(self, model: TrainableModel) -> Path:
        return self.path / model.project / "models" / model.name

    async def register(
        self,
        backend: TrainableBackend,
        model: TrainableModel,
        make_client: Callable[[Path], ClientT],
    ) -> None:
        """Create the model's client (`make_client(directory)`), resume its latest checkpoint.

        model.json is written only once the client is up: a registration that fails (a base
        model that does not exist, say) leaves nothing behind to trip the next attempt.
        """
        directory = self.model_dir(model)
        check_model_json(directory, model)
        # Before the client is made: a damaged latest checkpoint costs no model load.
        resume_step = model.take_resume_step()
        resume = resume_point(model, directory / "checkpoints", resume_step)
        try:
            client = await asyncio.to_thread(make_client, directory)
        except FileNotFoundError as exc:
            raise FileNotFoundError(missing_base_model(model, exc)) from exc
        attached = False
        try:
            step, run_state = 0, None
            if resume.checkpoint is not None:
                await client.load_state(str(resume.checkpoint), with_optimizer=True)
                step, run_state = read_trainer_state(resume.checkpoint)
            model.attach(backend, directory, step)  # opens the metric sinks, which may refuse
            attached = True
            write_model_json(directory, model)
            set_aside(resume.later, directory / "checkpoints", resume_step)
        except BaseException:
            client.close()
            if attached:
                model.detach()
            raise
        if run_state is not None:  # last: a failed registration leaves the model as it was
            model.run_state = run_state
        self._clients[id(model)] = client

    def client(self, model: TrainableModel) -> ClientT:
        try:
            return self._clients[id(model)]
        except KeyError:
            raise RuntimeError(
                f"model {model.name!r} is not registered with this backend; "
                "call `await model.register(backend)` first"
            ) from None

    async def train(
        self, model: TrainableModel, groups: Sequence[TrajectoryGroup], config: RLConfig
    ) -> TrainResult:
        """Preflight, one RL step through the shared trainer, then a checkpoint and the step."""
        preflight_rl(self.backend, self.capabilities, config, groups)
        client = self.client(model)
        batch = prepare_batch(groups, config)  # bad input fails here, before any update
        client.set_logprob_chunk_size(config.logprob_calculation_chunk_size)
        recorder = TensorRecorder() if config.plot_tensors else None
        step = model.step + 1
        plot = model.directory / "plots" / f"step_{step:05d}.png"

        async def run() -> StepMetrics:
            metrics = await train_rl_batch(client, batch, config, recorder=recorder)
            if recorder is not None:
                recorder.save(plot)
            return metrics

        return await self._step(model, step, run, config.save_checkpoint, leftovers=[plot])

    async def train_sft(
        self, model: TrainableModel, trajectories: Sequence[Trajectory], config: SFTConfig
    ) -> TrainResult:
        preflight_sft(self.backend, self.capabilities, config)
        client = self.client(model)
        batches = sft_batches(trajectories, config)  # bad input fails here, before any update

        async def run() -> StepMetrics:
            return await train_sft_batches(
                client, batches, config, num_trajectories=len(trajectories)
            )

        return await self._step(model, model.step + 1, run, config.save_checkpoint)

    async def _step(
        self,
        model: TrainableModel,
        step: int,
        run: Callable[[], Awaitable[StepMetrics]],
        save: bool,
        leftovers: Sequence[Path] = (),
    ) -> TrainResult:
        """Run the updates of `step`, checkpoint it, then (only then) advance the model's step."""
        path: str | None = None
        try:
            metrics = await run()
            if save:
                path = await self._save(model, step)
                prune_checkpoints(model.directory / "checkpoints", self.keep_checkpoints)
        except Exception as exc:
            for leftover in leftovers:
                leftover.unlink(missing_ok=True)
            if path is not None:  # saved, then pruning failed: the step is not done after all
                shutil.rmtree(path, ignore_errors=True)
            await self._restore(model, exc)
            raise
        model.set_step(step)
        return TrainResult(step=step, metrics=metrics.as_dict(), checkpoint_path=path)

    async def _restore(self, model: TrainableModel, error: Exception) -> None:
        """After a failed step: reload the checkpoint of the model's (unchanged) step."""
        last_good = model.directory / "checkpoints" / str(model.step)
        if not is_complete_checkpoint(last_good):
            error.add_note(
                f"model {model.name!r} stays at step {model.step}, but no checkpoint of that step "
                "exists to reload, so its weights in memory may include part of the failed step; "
                "register the model again to start from its latest checkpoint or base model"
            )
            return
        try:
            await self.client(model).load_state(str(last_good), with_optimizer=True)
        except Exception as reload_error:
            error.add_note(f"reloading {last_good} after the failure failed too: {reload_error!r}")

    async def checkpoint(self, model: TrainableModel) -> str:
        """Save the model's current state as `checkpoints/<step>`; keep the newest few."""
        path = await self._save(model, model.step)
        prune_checkpoints(model.directory / "checkpoints", self.keep_checkpoints)
        return path

    async def _save(self, model: TrainableModel, step: int) -> str:
        record = model_record(model.directory, model)
        state = {"step": step, "run_state": model.run_state, "model": record}
        saved = await self.client(model).save_state(str(step), trainer_state=state)
        return saved.path

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()


def read_trainer_state(checkpoint: Path) -> tuple[int, RunState]:
    """(step, run_state) saved with a checkpoint by `ModelClients`."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    missing = [key for key in ("step", "run_state") if key not in state]
    if missing:
        raise ValueError(
            f"{checkpoint}/trainer_state.json has no {' or '.join(missing)}: it was not written "
            "by a posttrain backend; move the checkpoint away or register under another name"
        )
    return int(state["step"]), dict(state["run_state"])


def missing_base_model(model: TrainableModel, error: FileNotFoundError) -> str:
    return (
        f"cannot register model {model.name!r}: base_model={model.base_model!r} is not a model "
        f"({error}). Pass an existing model directory (one with config.json, e.g. built by "
        "`posttrain make-tiny-model DIR`) or a Hugging Face hub id such as 'Qwen/Qwen3-0.6B'"
    )


def check_model_json(directory: Path, model: TrainableModel) -> None:
    """Refuse a directory that already holds a different model (another base or LoRA rank)."""
    path = directory / "model.json"
    if not path.exists():
        return
    saved = json.loads(path.read_text())
    config = model_record(directory, model)
    missing = [key for key in IDENTITY_KEYS if key not in saved]
    if missing:
        raise ValueError(f"{path} has no {', '.join(missing)}: it is not a posttrain model.json")
    # A model.json written before base models inside the directory were stored relative.
    saved = {**saved, "base_model": portable_base_model(str(saved["base_model"]), directory)}
    if any(saved[key] != config[key] for key in IDENTITY_KEYS):
        raise ValueError(
            f"{directory} already holds model {model.name!r} with base_model="
            f"{saved['base_model']!r}, lora_rank={saved['lora_rank']!r}; use another "
            "name or the same settings"
        )


def write_model_json(directory: Path, model: TrainableModel) -> None:
    """Check (as `check_model_json`), then write the model's settings to `model.json`."""
    check_model_json(directory, model)
    directory.mkdir(parents=True, exist_ok=True)
    record = model_record(directory, model)
    (directory / "model.json").write_text(json.dumps(record, indent=2) + "\n")


def model_record(directory: Path, model: TrainableModel) -> dict[str, object]:
    """The model's settings as written under `directory` (model.json, checkpoints): a base
    model inside the directory is named relative to it, so the directory can be moved or
    copied and resumed elsewhere."""
    return {**model.config_dict(), "base_model": portable_base_model(model.base_model, directory)}


def portable_base_model(base_model: str, directory: Path) -> str:
    """`./<path>` for a base model directory inside `directory`; any other value as it is."""
    path = Path(base_model)
    if base_model.startswith("./") or not path.exists():  # relative already, or a hub id
        return base_model
    try:
        inside = path.resolve().relative_to(directory.resolve())
    except ValueError:
        return base_model
    return f"./{inside.as_posix()}"
