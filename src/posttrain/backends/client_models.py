"""The model lifecycle every backend shares, whatever its training client.

`ModelClients` keeps the models a backend registered, each with its training client, and runs
the shared trainer on them: register (or resume from the latest checkpoint), one RL, SFT or DPO step,
checkpoint, close. What differs between backends sits behind the two small protocols of
`checkpoint_index`: how a client is made, reloaded and freed (`ClientSource`: `in_process.InProcessClients`
for LocalBackend and RayBackend), and where checkpoints are kept (`CheckpointIndex`).

Each registered model has one record (`model_record.ModelRecord`): its client, engine, critic
and reference. Its critic's lifecycle is `critics.Critics`; its steps run through the trainer's
step functions, all or nothing (`model_steps.ModelSteps`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Iterable
from pathlib import Path
from typing import Generic

from posttrain.backends.capabilities import Capabilities
from posttrain.backends.checkpoint_index import CheckpointIndex, ClientSource
from posttrain.backends.critics import Critics, delete_saved_critic
from posttrain.backends.inputs import group_list, pair_list, trajectory_list
from posttrain.backends.model import Model, TrainableModel
from posttrain.backends.model_json import check_model_json, write_model_json
from posttrain.backends.model_record import ClientT, ModelRecord
from posttrain.backends.model_steps import ModelSteps, WeightsHook, open_engine
from posttrain.backends.preflight import (
    PreflightError,
    PreflightProblem,
    precision_mismatch,
    preflight_rl,
    preflight_sft,
)
from posttrain.backends.protocol import TrainableBackend
from posttrain.clients.protocol import ReferenceScorer
from posttrain.clients.teacher import VocabularyMismatch
from posttrain.data.preferences import PreferencePair
from posttrain.data.trajectories import Trajectory, TrajectoryGroup
from posttrain.engine.checkpoint import delete_checkpoint, list_checkpoints
from posttrain.inference.config import InferenceConfig
from posttrain.inference.model_sampler import ModelSampler
from posttrain.inference.session import EngineSession
from posttrain.trainer.config import DPOConfig, RLConfig, SFTConfig
from posttrain.trainer.dpo import train_dpo
from posttrain.trainer.metrics import StepMetrics
from posttrain.trainer.rl import train_rl_step
from posttrain.trainer.sft import train_sft
from posttrain.trainer.steps import RunUpdates
from posttrain.trainer.tensor_plots import TensorRecorder
from posttrain.types import TrainResult

__all__ = ["ClientT", "ModelClients", "WeightsHook"]

log = logging.getLogger(__name__)
REFERENCE_DIR = "reference"  # a frozen reference's storage (it never saves anything)


class ModelClients(Generic[ClientT]):
    """Models under `path/<project>/models/<name>/`, each with its client and checkpoints."""

    def __init__(
        self,
        path: str | Path,
        *,
        backend: str,
        capabilities: Capabilities,
        clients: ClientSource[ClientT],
        index: CheckpointIndex[ClientT],
        after_update: WeightsHook | None = None,
        after_reload: WeightsHook | None = None,
        inference: InferenceConfig | None = None,
        critics: ClientSource[ClientT] | None = None,
        references: ClientSource[ClientT] | None = None,
    ) -> None:
        self.path = Path(path)
        self.backend = backend
        self.capabilities = capabilities
        self.clients = clients
        self.index = index
        self.inference = inference or InferenceConfig()
        self.critics = Critics(critics, backend)
        self.steps = ModelSteps(
            clients, index, self.critics, self.inference, after_update, after_reload
        )
        # Frozen base models of fully fine-tuned policies (`ModelRecord.reference`).
        self.references = references
        self._records: dict[int, ModelRecord[ClientT]] = {}  # by id(model)

    def model_dir(self, model: TrainableModel) -> Path:
        return self.path / model.project / "models" / model.name

    async def register(self, backend: TrainableBackend, model: TrainableModel) -> None:
        """Make the model's client, on its latest checkpoint if it has one, and attach it.

        Nothing is written before the client is up (model.json included): a registration that
        fails (a base model that does not exist, a metric sink that refuses) leaves nothing
        behind to trip the next attempt, frees the client it made, and leaves the model as it
        was (not attached, its run_state untouched).
        """
        directory = self.model_dir(model)
        check_model_json(directory, model)
        resume_step = model.take_resume_step()
        # Before the client is made: a damaged latest checkpoint costs no model load.
        resume = self.index.resume_point(model, directory, resume_step)
        checkpoint = resume.checkpoint
        path = checkpoint.path if checkpoint is not None else None
        client = await self.clients.open(model, directory, path)
        attached = False
        session: EngineSession | None = None
        step = checkpoint.step if checkpoint else 0
        critic: ClientT | None = None
        try:
            # Right after the policy, whose load restored the RNG: the critic's checkpoint holds
            # the same RNG state (saved just before the policy's), so loading it changes nothing.
            critic = await self.critics.open_saved(model, directory, step) if step > 0 else None
            session = await open_engine(self.inference, model, client, directory, step)
            model.attach(backend, directory, step)
            attached = True  # the metric sinks opened (they may refuse)
            write_model_json(directory, model)
            resume.set_aside()
        except BaseException:
            if attached:
                model.detach()
            if session is not None:
                await session.close()
            if critic is not None:
                await self.critics.release(critic)
            await self.clients.release(client)
            raise
        if checkpoint is not None:  # last: a failed registration leaves the model as it was
            model.run_state = dict(checkpoint.run_state)
        self._records[id(model)] = ModelRecord(model, client, session, critic=critic)

    def record(self, model: TrainableModel) -> ModelRecord[ClientT]:
        """The model's record; the one "not registered" error (and, for a `Model`, which
        registers for its logs alone, the one "not trainable" error)."""
        if isinstance(model, Model):
            raise TypeError(
                f"model {model.name!r} is a posttrain.Model, which is not trainable: it is "
                "sampled from its inference_base_url, and register gives it a log directory "
                "only; to train or sample it here, make it a posttrain.TrainableModel(name=..., "
                "project=..., base_model=...) and register that"
            )
        try:
            return self._records[id(model)]
        except KeyError:
            raise RuntimeError(
                f"model {model.name!r} is not registered with this backend; "
                "call `await model.register(backend)` first"
            ) from None

    def registered_models(self) -> list[TrainableModel]:
        """The registered models, the latest of each project and name."""
        latest = {(r.model.project, r.model.name): r.model for r in self._records.values()}
        return list(latest.values())

    def client(self, model: TrainableModel) -> ClientT:
        return self.record(model).client

    def engine(self, model: TrainableModel) -> EngineSession:
        """The engine session the model samples with."""
        return self.record(model).engine

    def critic(self, model: TrainableModel) -> ClientT | None:
        """The model's critic (a value model), None before its first 'gae' step."""
        return self.record(model).critic

    def sampling_client(self, model: TrainableModel) -> ModelSampler:
        record = self.record(model)
        return ModelSampler(
            record.client, record.client.get_tokenizer(), engine=record.engine.engine
        )

    async def _reference(self, record: ModelRecord[ClientT]) -> ReferenceScorer | None:
        """The frozen base model a fully fine-tuned policy's reference logprobs come from, in
        workers of its own (placed and sharded like the policy's); None for a LoRA policy,
        whose reference is itself with the adapters off, or without a reference source."""
        model = record.model
        if model.lora_rank is not None or self.references is None:
            return None
        if record.reference is None:
            directory = model.directory / REFERENCE_DIR
            record.reference = await self.references.open(model, directory, None)
        if not isinstance(record.reference, ReferenceScorer):
            raise TypeError(f"{type(record.reference).__name__} cannot score reference logprobs")
        return record.reference

    async def train(
        self, model: TrainableModel, trajectory_groups: Iterable[TrajectoryGroup], config: RLConfig
    ) -> TrainResult:
        """Preflight, one RL step through the shared trainer, then a checkpoint and the step."""
        groups = group_list(trajectory_groups, f"{self.backend}.train()")  # read once, here
        preflight_rl(self.backend, self.capabilities, config, groups)
        record = self.record(model)
        inference = self.inference
        sample_dtype = None if inference.placement == "here" else inference.dtype
        mismatch = precision_mismatch(model.dtype, sample_dtype, config)
        if mismatch is not None and not record.warned_precision:
            record.warned_precision = True
            log.warning("%s: %s", model.name, mismatch)
        recorder = TensorRecorder() if config.plot_tensors else None
        step = model.step + 1
        plot = model.directory / "plots" / f"step_{step:05d}.png"
        before = dict(model.run_state)
        parity = self.steps.parity_check(record, _first_prompt(groups))

        def trainer_step(run: RunUpdates) -> Awaitable[StepMetrics]:
            return train_rl_step(
                record.client,
                groups,
                config,
                run_state=model.run_state,
                recorder=recorder,
                critic=lambda: self.critics.of(record),
                reference=lambda: self._reference(record),
                student=f"{model.name!r} (base_model={model.base_model!r})",
                run=run,
                parity=parity,
            )

        try:
            plotted = (recorder, plot) if recorder is not None else None
            return await self.steps.run(
                record, step, trainer_step, config.save_checkpoint, plotted, parity
            )
        except VocabularyMismatch as exc:  # before any update: a refused configuration
            raise PreflightError(self.backend, [PreflightProblem("teacher", str(exc))]) from exc
        except BaseException:
            model.run_state.clear()  # a failed step leaves the controller state as it was
            model.run_state.update(before)
            raise

    async def train_sft(
        self, model: TrainableModel, trajectories: Iterable[Trajectory], config: SFTConfig
    ) -> TrainResult:
        listed = trajectory_list(trajectories, f"{self.backend}.train_sft()")  # read once, here
        preflight_sft(self.backend, self.capabilities, config)
        record = self.record(model)

        def trainer_step(run: RunUpdates) -> Awaitable[StepMetrics]:
            return train_sft(record.client, listed, config, run=run)

        return await self.steps.run(record, model.step + 1, trainer_step, config.save_checkpoint)

    async def train_dpo(
        self, model: TrainableModel, pairs: Iterable[PreferencePair], config: DPOConfig
    ) -> TrainResult:
        """Preference pairs -> DPO updates through the shared trainer, as one step."""
        listed = pair_list(pairs, f"{self.backend}.train_dpo()")  # read once, here
        record = self.record(model)

        def trainer_step(run: RunUpdates) -> Awaitable[StepMetrics]:
            return train_dpo(
                record.client, listed, config, reference=lambda: self._reference(record), run=run
            )

        return await self.steps.run(record, model.step + 1, trainer_step, config.save_checkpoint)

    def checkpoint_steps(self, model: TrainableModel) -> list[int]:
        """The steps of the model's complete step-directory checkpoints, oldest first."""
        self.record(model)  # raises unless registered here
        return [int(p.name) for p in list_checkpoints(model.directory / "checkpoints")]

    async def delete_checkpoints(self, model: TrainableModel, keep: set[int]) -> list[int]:
        """Delete the model's checkpoints (and critics) of the steps not in `keep`."""
        doomed = [step for step in self.checkpoint_steps(model) if step not in keep]
        for step in doomed:
            delete_checkpoint(model.directory / "checkpoints" / str(step))
            delete_saved_critic(model.directory, step)
        return doomed

    async def checkpoint(self, model: TrainableModel) -> str:
        """Save the model's current state (its critic's too) as the checkpoint of its step."""
        return await self.steps.save(self.record(model), model.step)

    async def close(self) -> None:
        records = list(self._records.values())
        try:
            for record in records:
                await record.engine.close()
        finally:
            self._records.clear()
            critics = [r.critic for r in records if r.critic is not None]
            references = [r.reference for r in records if r.reference is not None]
            for client in [*(r.client for r in records), *critics, *references]:
                client.close()


def _first_prompt(groups: list[TrajectoryGroup]) -> list[int] | None:
    """The tokens before the first trajectory's first sampled segment (the parity probe's
    prompt); None when it starts with one."""
    for group in groups:
        for trajectory in group.trajectories:
            prompt: list[int] = []
            for segment in trajectory.segments:
                if segment.trainable:
                    return prompt or None
                prompt.extend(segment.tokens)
    return None
