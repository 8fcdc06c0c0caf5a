"""A registered model's step, all or nothing, whatever the backend's training client.

The trainer's step function (`trainer.steps`) checks its input and prepares first; then its
updates run here, with the plots, the weights hooks, the engine's sync and the checkpoint. The
model's step advances only once all of them are done. If any fails, the step and the
checkpoints stay as they were and the client (and critic) are reloaded from the checkpoint of
the current step, so a retry starts from the last good state.

An RL step also checks that the engine samples the trained policy (`trainer.parity`): on its
own on-policy tokens before the first update, else with a probe right after the sync
(`parity_probe`), inside the all-or-nothing block, so a failed probe undoes the step.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Generic

from posttrain.backends.checkpoint_index import CheckpointIndex, ClientSource
from posttrain.backends.critics import Critics
from posttrain.backends.model import TrainableModel
from posttrain.backends.model_record import ClientT, ModelRecord
from posttrain.backends.parity_probe import probe_engine
from posttrain.clients.protocol import TrainingClient
from posttrain.inference.config import InferenceConfig
from posttrain.inference.session import EngineSession
from posttrain.trainer.metrics import StepMetrics
from posttrain.trainer.parity import ParityCheck, parity_precision
from posttrain.trainer.steps import RunUpdates, Updates
from posttrain.trainer.tensor_plots import TensorRecorder
from posttrain.types import TrainResult

# Called with the model and its step once its client's weights changed: after a step's updates
# (a failure fails the step), or after a failed step's reload (a failure becomes a note).
WeightsHook = Callable[[TrainableModel, int], Awaitable[None]]
# A trainer step function, given how to run its updates (`trainer.steps`).
TrainerStep = Callable[[RunUpdates], Awaitable[StepMetrics]]

log = logging.getLogger(__name__)


async def open_engine(
    inference: InferenceConfig,
    model: TrainableModel,
    client: TrainingClient,
    directory: Path,
    version: int,
) -> EngineSession:
    """The engine session the model samples `client`'s weights with."""
    return await EngineSession.open(
        inference,
        client,
        base_model=model.base_model,
        lora=model.lora,
        version=version,
        log_dir=directory / "logs",
    )


class ModelSteps(Generic[ClientT]):
    """Runs, saves and (after a failure) restores the steps of registered models."""

    def __init__(
        self,
        clients: ClientSource[ClientT],
        index: CheckpointIndex[ClientT],
        critics: Critics[ClientT],
        inference: InferenceConfig,
        after_update: WeightsHook | None = None,
        after_reload: WeightsHook | None = None,
    ) -> None:
        self.clients = clients
        self.index = index
        self.critics = critics
        self.inference = inference
        self.after_update = after_update
        self.after_reload = after_reload
        self._parity_skip_noted: set[int] = set()  # id(record): the skip logged once

    def parity_check(
        self, record: ModelRecord[ClientT], probe_prompt: Sequence[int] | None
    ) -> ParityCheck | None:
        """The parity check of the model's next RL step, or None: `[inference] parity_check
        = 'off'`, or an engine whose logprobs cannot be held to the trainer's (it returns
        none, or samples a fixed policy, sync = 'none'), which is logged once."""
        mode = self.inference.parity_check
        if mode == "off":
            return None
        engine = record.engine.engine
        model = record.model
        capabilities = engine.capabilities
        if capabilities.weight_sync == "none" or not capabilities.returns_logprobs:
            if id(record) not in self._parity_skip_noted:
                self._parity_skip_noted.add(id(record))
                why = (
                    "samples a fixed policy (sync = 'none')"
                    if capabilities.weight_sync == "none"
                    else "returns no logprobs"
                )
                log.info("%s: no parity check: the %r engine %s", model.name, engine.name, why)
            return None
        live = capabilities.weight_sync == "live"  # the training weights: the trainer's dtype
        return ParityCheck(
            engine=engine.name,
            model_step=model.step,
            precision=parity_precision(model.dtype, None if live else self.inference.dtype),
            mode=mode,
            # A failed step's gradients go with the reload of this step's checkpoint.
            undoable=self.index.checkpoint_of(model.directory, model.step) is not None,
            # The live engine samples the training weights themselves: nothing to probe.
            probe_prompt=None if live or probe_prompt is None else tuple(probe_prompt),
        )

    async def run(
        self,
        record: ModelRecord[ClientT],
        step: int,
        trainer_step: TrainerStep,
        save: bool,
        plot: tuple[TensorRecorder, Path] | None = None,
        parity: ParityCheck | None = None,
    ) -> TrainResult:
        """Run the trainer's step: its checks first, then (all or nothing) its updates, the
        tensor plot, the weights hooks, the engine's sync (and, when the updates compared no
        on-policy token with `parity`, its probe) and the checkpoint; only then does the step
        advance."""
        model, engine = record.model, record.engine
        path: str | None = None

        async def run(updates: Updates) -> StepMetrics:
            nonlocal path
            try:
                metrics = await updates()
                if plot is not None:
                    plot[0].save(plot[1])
                if self.after_update is not None:
                    await self.after_update(model, step)
                await engine.sync(step)
                if parity is not None and parity.compared.count == 0:
                    await probe_engine(engine.engine, record.client, parity, step)
                if save:
                    path = await self.save(record, step)
            except Exception as exc:
                if plot is not None:
                    plot[1].unlink(missing_ok=True)
                await self.restore(record, exc)
                raise
            model.set_step(step)
            return metrics

        metrics = await trainer_step(run)
        result = metrics.as_dict() | engine.policy_gap(step)
        if parity is not None:
            result |= parity.metrics()  # what the check judged: on-policy tokens or the probe
        sync = dict(engine.last_sync)  # the sync of this step: `run` ran it
        return TrainResult(step=step, metrics=result, checkpoint_path=path, sync=sync)

    async def save(self, record: ModelRecord[ClientT], step: int) -> str:
        """Save the model's state (its critic's too) as the checkpoint of `step`."""
        # The critic first: a policy checkpoint of `step` then implies its critic's.
        await self.critics.save(record, step)
        path = await self.index.save(record.client, record.model, step)
        self.critics.prune(record)
        return path

    async def restore(self, record: ModelRecord[ClientT], error: Exception) -> None:
        """After a failed step: reload the checkpoint of the model's (unchanged) step."""
        model = record.model
        await self.critics.restore(record, error)
        last_good = self.index.checkpoint_of(model.directory, model.step)
        if last_good is None:
            error.add_note(
                f"model {model.name!r} stays at step {model.step}, but no checkpoint of that step "
                "exists to reload, so its weights may include part of the failed step; "
                "register the model again to start from its latest checkpoint or base model"
            )
            return
        old = record.client
        try:
            client = await self.clients.reload(old, last_good)
        except Exception as reload_error:
            error.add_note(f"reloading {last_good} after the failure failed too: {reload_error!r}")
            return
        if client is not old:
            record.client = client
            await self.clients.release(old)  # the failed step's
            await self._reopen_engine(record)
        else:
            await self._sync_after_reload(record, error)
        if self.after_reload is not None:
            try:
                await self.after_reload(model, model.step)
            except Exception as hook_error:
                error.add_note(f"after reloading {last_good}: {hook_error}")

    async def _reopen_engine(self, record: ModelRecord[ClientT]) -> None:
        """A new client after a failed step: a new engine on it (the old one sampled the old
        client)."""
        model = record.model
        await record.engine.close()
        record.engine = await open_engine(
            self.inference, model, record.client, model.directory, model.step
        )  # a failure here fails the step's recovery: the model cannot sample

    async def _sync_after_reload(self, record: ModelRecord[ClientT], error: Exception) -> None:
        try:
            await record.engine.sync(record.model.step)
        except Exception as sync_error:
            error.add_note(f"syncing the engine to the reloaded weights failed: {sync_error!r}")
