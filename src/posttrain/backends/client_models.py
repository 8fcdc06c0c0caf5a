"""The model lifecycle every backend shares, whatever its training client.

`ModelClients` keeps the models a backend registered, each with its training client, and runs
the shared trainer on them: register (or resume from the latest checkpoint), one RL, SFT or DPO step,
checkpoint, close. What differs between backends sits behind the two small protocols of
`checkpoint_index`: how a client is made, reloaded and freed (`ClientSource`: `in_process.InProcessClients`
for LocalBackend and RayBackend), and where checkpoints are kept (`CheckpointIndex`).

A step is all or nothing: the model's step advances only once its updates, plots and
checkpoint are done. If any of them fails, the step and the checkpoints stay as they were and
the client is reloaded from the checkpoint of the current step, so a retry starts from the
last good state.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Generic, TypeVar

import torch

from posttrain.backends.capabilities import Capabilities
from posttrain.backends.checkpoint_index import CheckpointIndex, ClientSource
from posttrain.backends.inputs import group_list, pair_list, trajectory_list
from posttrain.backends.model import TrainableModel
from posttrain.backends.model_json import check_model_json, write_model_json
from posttrain.backends.preflight import (
    PreflightError,
    PreflightProblem,
    precision_mismatch,
    preflight_rl,
    preflight_sft,
)
from posttrain.backends.protocol import TrainableBackend
from posttrain.backends.sampling import ModelSampler
from posttrain.clients.protocol import LogprobChunking, ReferenceScorer, TrainingClient
from posttrain.data.preferences import PreferencePair
from posttrain.data.trajectories import Trajectory, TrajectoryGroup
from posttrain.engine.checkpoint import (
    delete_checkpoint,
    is_complete_checkpoint,
    list_checkpoints,
    step_directories,
)
from posttrain.inference.config import InferenceConfig
from posttrain.inference.session import EngineSession
from posttrain.trainer.config import DPOConfig, RLConfig, SFTConfig
from posttrain.trainer.distill import score_groups
from posttrain.trainer.dpo import dpo_batches, train_dpo_batches
from posttrain.trainer.metrics import StepMetrics
from posttrain.trainer.rl import prepare_batch, train_rl_batch
from posttrain.trainer.sft import sft_batches, train_sft_batches
from posttrain.trainer.tensor_plots import TensorRecorder
from posttrain.types import TrainResult

log = logging.getLogger(__name__)
ClientT = TypeVar("ClientT", bound=TrainingClient)
CRITIC_DIR = "critic"  # a model's critic: its checkpoints, under the model's directory
REFERENCE_DIR = "reference"  # a frozen reference's storage (it never saves anything)
# Called with the model and its step once its client's weights changed: after a step's updates
# (a failure fails the step), or after a failed step's reload (a failure becomes a note).
WeightsHook = Callable[[TrainableModel, int], Awaitable[None]]


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
        self.after_update = after_update
        self.after_reload = after_reload
        self.inference = inference or InferenceConfig()
        # Value models of PPO with a critic (`trainer.critic`), made at a model's first 'gae'
        # step, checkpointed beside its policy under `critic/checkpoints/<step>`.
        self.critics = critics
        self._critics: dict[int, ClientT] = {}
        # Frozen base models of fully fine-tuned policies: their KL (and DPO) reference, made
        # at first use, in workers of their own (LoRA policies switch their adapters off).
        self.references = references
        self._references: dict[int, ClientT] = {}
        self._warned_precision: set[int] = set()
        self._clients: dict[int, ClientT] = {}
        self._engines: dict[int, EngineSession] = {}
        self._registered: dict[tuple[str, str], TrainableModel] = {}

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
            critic = await self._open_critic(model, directory, step) if step > 0 else None
            session = await self._open_engine(model, client, directory, step)
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
                await self._release_critic(critic)
            await self.clients.release(client)
            raise
        if checkpoint is not None:  # last: a failed registration leaves the model as it was
            model.run_state = dict(checkpoint.run_state)
        self._clients[id(model)] = client
        if critic is not None:
            self._critics[id(model)] = critic
        self._engines[id(model)] = session
        self._registered[(model.project, model.name)] = model

    async def _open_critic(
        self, model: TrainableModel, directory: Path, step: int
    ) -> ClientT | None:
        """The critic saved with `step`'s checkpoint, if the run has one (None otherwise)."""
        if self.critics is None:
            return None
        saved = critic_checkpoint(directory, step)
        if not is_complete_checkpoint(saved):
            return None
        return await self.critics.open(model, directory / CRITIC_DIR, str(saved))

    async def _critic(self, model: TrainableModel) -> ClientT:
        """The model's critic: the one it has, else a new one on the base model."""
        critic = self._critics.get(id(model))
        if critic is not None:
            return critic
        if self.critics is None:
            raise RuntimeError(f"{self.backend} has no critic (supports_critic=false)")
        earlier = step_directories(model.directory / CRITIC_DIR / "checkpoints")
        if earlier:  # the run had a critic, but its step saved none (save_checkpoint=False)
            log.warning(
                "model %r starts a new critic at step %d: no critic was saved with that step "
                "(the last was at step %s), so its values start from the base model",
                model.name,
                model.step,
                earlier[-1].name,
            )
        critic = await self.critics.open(model, model.directory / CRITIC_DIR, None)
        self._critics[id(model)] = critic
        return critic

    async def _reference(self, model: TrainableModel) -> ReferenceScorer | None:
        """The frozen base model a fully fine-tuned policy's reference logprobs come from, in
        workers of its own (placed and sharded like the policy's); None for a LoRA policy,
        whose reference is itself with the adapters off, or without a reference source."""
        if model.lora_rank is not None or self.references is None:
            return None
        reference = self._references.get(id(model))
        if reference is None:
            reference = await self.references.open(model, model.directory / REFERENCE_DIR, None)
            self._references[id(model)] = reference
        if not isinstance(reference, ReferenceScorer):
            raise TypeError(f"{type(reference).__name__} cannot score reference logprobs")
        return reference

    async def _release_critic(self, critic: ClientT) -> None:
        assert self.critics is not None
        await self.critics.release(critic)

    async def _open_engine(
        self, model: TrainableModel, client: ClientT, directory: Path, version: int
    ) -> EngineSession:
        return await EngineSession.open(
            self.inference,
            client,
            base_model=model.base_model,
            lora_rank=model.lora_rank,
            lora_alpha=model.lora_alpha,
            version=version,
            log_dir=directory / "logs",
        )

    def engine(self, model: TrainableModel) -> EngineSession:
        """The engine session the model samples with."""
        self.client(model)  # the clear "not registered" error
        return self._engines[id(model)]

    def registered_models(self) -> list[TrainableModel]:
        return list(self._registered.values())

    def client(self, model: TrainableModel) -> ClientT:
        try:
            return self._clients[id(model)]
        except KeyError:
            raise RuntimeError(
                f"model {model.name!r} is not registered with this backend; "
                "call `await model.register(backend)` first"
            ) from None

    def critic(self, model: TrainableModel) -> ClientT | None:
        """The model's critic (a value model), None before its first 'gae' step."""
        self.client(model)  # the clear "not registered" error
        return self._critics.get(id(model))

    def sampling_client(self, model: TrainableModel) -> ModelSampler:
        client = self.client(model)
        return ModelSampler(client, client.get_tokenizer(), engine=self._engines[id(model)].engine)

    async def train(
        self, model: TrainableModel, trajectory_groups: Iterable[TrajectoryGroup], config: RLConfig
    ) -> TrainResult:
        """Preflight, one RL step through the shared trainer, then a checkpoint and the step."""
        groups = group_list(trajectory_groups, f"{self.backend}.train()")  # read once, here
        preflight_rl(self.backend, self.capabilities, config, groups)
        mismatch = precision_mismatch(
            model.dtype, self.inference.dtype, self.inference.engine, config
        )
        if mismatch is not None and id(model) not in self._warned_precision:
            self._warned_precision.add(id(model))
            log.warning("%s: %s", model.name, mismatch)
        client = self.client(model)
        teacher_logprobs = await self._score_with_teacher(model, client, config, groups)
        # Bad input fails here, before any update. The advantage flow reads its controller
        # state (SEPA) from run_state; the tokenizer is fetched only to find planning tokens.
        batch = prepare_batch(
            groups,
            config,
            run_state=model.run_state,
            tokenizer=client.get_tokenizer,
            teacher_logprobs=teacher_logprobs,
        )
        if isinstance(client, LogprobChunking):
            client.set_logprob_chunk_size(config.logprob_calculation_chunk_size)
        recorder = TensorRecorder() if config.plot_tensors else None
        critic = (
            await self._critic(model) if config.advantages.advantage_estimator == "gae" else None
        )
        kl = config.loss_fn_config.kl_penalty_coef > 0
        reference = await self._reference(model) if kl else None
        step = model.step + 1
        plot = model.directory / "plots" / f"step_{step:05d}.png"
        before = dict(model.run_state)

        async def run() -> StepMetrics:
            metrics = await train_rl_batch(
                client, batch, config, recorder=recorder, critic=critic, reference=reference
            )
            if recorder is not None:
                recorder.save(plot)
            model.run_state.update(batch.run_state)  # saved with this step's checkpoint
            return metrics

        try:
            return await self._step(model, step, run, config.save_checkpoint, leftovers=[plot])
        except BaseException:
            model.run_state.clear()  # a failed step leaves the controller state as it was
            model.run_state.update(before)
            raise

    async def _score_with_teacher(
        self,
        model: TrainableModel,
        client: ClientT,
        config: RLConfig,
        groups: Sequence[TrajectoryGroup],
    ) -> list[list[torch.Tensor]] | None:
        """With a teacher: refuse one whose vocabulary is not the student's (a PreflightError
        naming both), then the teacher's logprobs of every trajectory. Before any update."""
        teacher = config.distill.teacher
        if teacher is None:
            return None
        student = f"{model.name!r} (base_model={model.base_model!r})"
        try:
            teacher.check_vocabulary(client.get_tokenizer(), student)
        except ValueError as exc:
            raise PreflightError(self.backend, [PreflightProblem("teacher", str(exc))]) from exc
        return await score_groups(teacher, groups)

    async def train_sft(
        self, model: TrainableModel, trajectories: Iterable[Trajectory], config: SFTConfig
    ) -> TrainResult:
        listed = trajectory_list(trajectories, f"{self.backend}.train_sft()")  # read once, here
        preflight_sft(self.backend, self.capabilities, config)
        client = self.client(model)
        batches = sft_batches(listed, config)  # bad input fails here, before any update

        async def run() -> StepMetrics:
            return await train_sft_batches(client, batches, config, num_trajectories=len(listed))

        return await self._step(model, model.step + 1, run, config.save_checkpoint)

    async def train_dpo(
        self, model: TrainableModel, pairs: Iterable[PreferencePair], config: DPOConfig
    ) -> TrainResult:
        """Preference pairs -> DPO updates through the shared trainer, as one step."""
        listed = pair_list(pairs, f"{self.backend}.train_dpo()")  # read once, here
        client = self.client(model)
        batches = dpo_batches(listed, config)  # bad input fails here, before any update
        reference = await self._reference(model) if config.reference == "base" else None

        async def run() -> StepMetrics:
            return await train_dpo_batches(client, listed, batches, config, reference)

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
        engine = self._engines[id(model)]
        try:
            metrics = await run()
            if self.after_update is not None:
                await self.after_update(model, step)
            await engine.sync(step)
            if save:
                # The critic first: a policy checkpoint of `step` then implies its critic's.
                await self._save_critic(model, step)
                path = await self.index.save(self.client(model), model, step)
                self._prune_critics(model)
        except Exception as exc:
            for leftover in leftovers:
                leftover.unlink(missing_ok=True)
            await self._restore(model, exc)
            raise
        model.set_step(step)
        result = metrics.as_dict() | engine.policy_gap(step)
        return TrainResult(step=step, metrics=result, checkpoint_path=path)

    async def _save_critic(self, model: TrainableModel, step: int) -> None:
        critic = self._critics.get(id(model))
        if critic is None:
            return
        await critic.save_state(str(step))

    def _prune_critics(self, model: TrainableModel) -> None:
        """Drop the critics of steps whose policy checkpoint the index pruned."""
        if id(model) not in self._critics:
            return
        kept = {p.name for p in step_directories(model.directory / "checkpoints")}
        for saved in step_directories(model.directory / CRITIC_DIR / "checkpoints"):
            if saved.name not in kept and int(saved.name) < model.step:
                shutil.rmtree(saved, ignore_errors=True)

    async def _restore_critic(self, model: TrainableModel, error: Exception) -> None:
        """After a failed step: the critic of the model's step, or none (made anew when next
        needed) if that step saved no critic."""
        critic = self._critics.get(id(model))
        if critic is None:
            return
        saved = critic_checkpoint(model.directory, model.step)
        try:
            if is_complete_checkpoint(saved):
                await critic.load_state(str(saved), with_optimizer=True)
                return
        except Exception as reload_error:
            error.add_note(f"reloading the critic from {saved} failed: {reload_error!r}")
        del self._critics[id(model)]
        await self._release_critic(critic)

    async def _restore(self, model: TrainableModel, error: Exception) -> None:
        """After a failed step: reload the checkpoint of the model's (unchanged) step."""
        await self._restore_critic(model, error)
        last_good = self.index.checkpoint_of(model.directory, model.step)
        if last_good is None:
            error.add_note(
                f"model {model.name!r} stays at step {model.step}, but no checkpoint of that step "
                "exists to reload, so its weights may include part of the failed step; "
                "register the model again to start from its latest checkpoint or base model"
            )
            return
        old = self.client(model)
        try:
            client = await self.clients.reload(old, last_good)
        except Exception as reload_error:
            error.add_note(f"reloading {last_good} after the failure failed too: {reload_error!r}")
            return
        if client is not old:
            self._clients[id(model)] = client
            await self.clients.release(old)  # the failed step's
            await self._reopen_engine(model, client)
        else:
            await self._sync_after_reload(model, error)
        if self.after_reload is not None:
            try:
                await self.after_reload(model, model.step)
            except Exception as hook_error:
                error.add_note(f"after reloading {last_good}: {hook_error}")

    def checkpoint_steps(self, model: TrainableModel) -> list[int]:
        """The steps of the model's complete step-directory checkpoints, oldest first."""
        self.client(model)  # raises unless registered here
        return [int(p.name) for p in list_checkpoints(model.directory / "checkpoints")]

    async def delete_checkpoints(self, model: TrainableModel, keep: set[int]) -> list[int]:
        """Delete the model's checkpoints (and critics) of the steps not in `keep`."""
        doomed = [step for step in self.checkpoint_steps(model) if step not in keep]
        for step in doomed:
            delete_checkpoint(model.directory / "checkpoints" / str(step))
            shutil.rmtree(critic_checkpoint(model.directory, step), ignore_errors=True)
        return doomed

    async def checkpoint(self, model: TrainableModel) -> str:
        """Save the model's current state (its critic's too) as the checkpoint of its step."""
        await self._save_critic(model, model.step)
        path = await self.index.save(self.client(model), model, model.step)
        self._prune_critics(model)
        return path

    async def _reopen_engine(self, model: TrainableModel, client: ClientT) -> None:
        """A new client after a failed step: a new engine on it (the old one sampled the old
        client)."""
        await self._engines.pop(id(model)).close()
        self._engines[id(model)] = await self._open_engine(
            model, client, model.directory, model.step
        )  # a failure here fails the step's recovery: the model cannot sample

    async def _sync_after_reload(self, model: TrainableModel, error: Exception) -> None:
        try:
            await self._engines[id(model)].sync(model.step)
        except Exception as sync_error:
            error.add_note(f"syncing the engine to the reloaded weights failed: {sync_error!r}")

    async def close(self) -> None:
        try:
            for session in self._engines.values():
                await session.close()
        finally:
            self._engines.clear()
            others = [*self._critics.values(), *self._references.values()]
            for client in [*self._clients.values(), *others]:
                client.close()
            self._clients.clear()
            self._critics.clear()
            self._references.clear()
            self._registered.clear()


def critic_checkpoint(directory: Path, step: int) -> Path:
    """Where the critic saved with the policy checkpoint of `step` is."""
    return directory / CRITIC_DIR / "checkpoints" / str(step)
