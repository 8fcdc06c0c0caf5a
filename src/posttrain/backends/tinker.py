"""TinkerBackend: the backend-first API over the official `tinker` SDK.

It runs the shared trainer against a TinkerTrainingClient, so it works against the Tinker
service and against `posttrain serve` alike. Its options are what Tinker's wire protocol can
carry (`RLOptions`, `SFTOptions`); anything else is a pyright error and a TypeError.

Checkpoints live on the service (`tinker://...` paths). The model directory under `path`
keeps `model.json`, `history.jsonl` and `checkpoints.jsonl`, an index of those paths with the
trainer state of each, from which `register` resumes (weights and optimizer on the service,
step and `run_state` here).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Unpack, get_args

from posttrain.backends.capabilities import Capabilities
from posttrain.backends.client_models import check_model_json, write_model_json
from posttrain.backends.inputs import group_list, trajectory_list
from posttrain.backends.options import (
    RLOptions,
    SFTOptions,
    document,
    resolve_rl,
    resolve_sft,
)
from posttrain.backends.preflight import preflight_register, preflight_rl, preflight_sft
from posttrain.backends.sampling import SamplingClient
from posttrain.clients.tinker import TinkerTrainingClient, import_tinker, unload_model
from posttrain.model import OpenAIEndpoint, TrainableModel
from posttrain.trainer.config import ProtocolPolicyLoss, RLConfig
from posttrain.trainer.metrics import StepMetrics
from posttrain.trainer.rl import prepare_batch, train_rl_batch
from posttrain.trainer.sft import sft_batches, train_sft_batches
from posttrain.types import TrainResult, Trajectory, TrajectoryGroup

BACKEND = "TinkerBackend"
INDEX = "checkpoints.jsonl"
# One sampler checkpoint per model, overwritten by each step: storage stays bounded, and the
# server serves the new weights under the same name (it evicts the old ones on overwrite).
OPENAI_NAME = "openai"

log = logging.getLogger(__name__)

TINKER = Capabilities(
    reports_sync_loss=True,  # the loss comes back from the forward_backward that made the gradient
    preserves_token_advantages=True,  # per-token advantages travel as arrays
    supports_checkpoint_resume=True,
    resume_runtime_dependent=True,  # checkpoints live on the service that wrote them
    supports_sft=True,
    supports_kl_reference=False,
    supports_sampling=True,
    device_kinds=("remote",),
)


class TinkerRLOptions(RLOptions, total=False, closed=True):
    """TinkerBackend.train() options: exactly what the Tinker protocol carries."""


document(TinkerRLOptions, RLConfig)


class TinkerBackend:
    """Train LoRA adapters on a Tinker-protocol server (the Tinker service or `posttrain serve`).

    `base_url=None` uses `$TINKER_BASE_URL` or the SDK's default service; `api_key=None` uses
    `$TINKER_API_KEY` (keys start with `tml-`).
    """

    capabilities: ClassVar[Capabilities] = TINKER
    rl_options: ClassVar[type] = TinkerRLOptions
    sft_options: ClassVar[type] = SFTOptions

    def __init__(
        self,
        path: str | Path = ".posttrain",
        *,
        base_url: str | None = None,
        api_key: str | None = None,
    ) -> None:
        self.path = Path(path)
        self.base_url = base_url
        self.api_key = api_key
        self._service: Any = None
        self._clients: dict[int, TinkerTrainingClient] = {}
        # Models served through openai_endpoint: (step, tinker path of its sampler weights).
        self._published: dict[int, tuple[int, str]] = {}

    def service_client(self) -> Any:
        """The SDK's ServiceClient (created on first use; it connects lazily)."""
        if self._service is None:
            tinker = import_tinker()
            self._service = tinker.ServiceClient(base_url=self.base_url, api_key=self.api_key)
        return self._service

    def model_dir(self, model: TrainableModel) -> Path:
        return self.path / model.project / "models" / model.name

    async def register(self, model: TrainableModel) -> None:
        """Create the model's LoRA on the service, or resume it from its latest checkpoint.

        The base model must be at hand here too (its tokenizer loads locally): checked first.
        A registration that fails after the service made the model frees it there, and leaves
        the model as it was (not attached, its run_state untouched).
        """
        if model.lora_rank is None:
            raise ValueError(
                f"{BACKEND} trains LoRA adapters only: give TrainableModel a lora_rank "
                "(e.g. lora_rank=8), or use LocalBackend/RayBackend for full fine-tuning"
            )
        directory = self.model_dir(model)
        check_model_json(directory, model)  # written below, once the service has the model
        await preflight_register(BACKEND, model)
        service = self.service_client()
        resume_step = model.take_resume_step()
        latest, later = resume_record(directory, resume_step)
        run_state = None
        if latest is None:
            training = await service.create_lora_training_client(
                model.base_model, rank=model.lora_rank, seed=model.seed
            )
            step = 0
        else:
            training = await service.create_training_client_from_state_with_optimizer(
                latest["path"]
            )
            step, run_state = int(latest["step"]), dict(latest.get("run_state", {}))
        client, attached = None, False
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, model.base_model)
            client = TinkerTrainingClient(training, tokenizer)
            model.attach(self, directory, step)  # opens the metric sinks, which may refuse
            attached = True
            write_model_json(directory, model)
            set_aside_records(directory, later, resume_step)
        except BaseException:
            if client is not None:
                client.close()
            if attached:
                model.detach()
            await self._release(training)
            raise
        self._clients[id(model)] = client
        if run_state is not None:  # last: a failed registration leaves the model as it was
            model.run_state = run_state

    def client(self, model: TrainableModel) -> TinkerTrainingClient:
        try:
            return self._clients[id(model)]
        except KeyError:
            raise RuntimeError(
                f"model {model.name!r} is not registered with this backend; "
                "call `await model.register(backend)` first"
            ) from None

    async def train(
        self,
        model: TrainableModel,
        trajectory_groups: Iterable[TrajectoryGroup],
        **options: Unpack[TinkerRLOptions],
    ) -> TrainResult:
        """One RL step through the shared trainer on `trajectory_groups` (any iterable, read
        once); the loss runs on the server."""
        config = resolve_tinker_rl(options)
        groups = group_list(trajectory_groups, f"{BACKEND}.train()")
        preflight_rl(BACKEND, self.capabilities, config, groups)
        client = self.client(model)
        batch = prepare_batch(groups, config)  # bad input fails before any update
        return await self._step(
            model, lambda: train_rl_batch(client, batch, config), config.save_checkpoint
        )

    async def train_sft(
        self,
        model: TrainableModel,
        trajectories: Iterable[Trajectory],
        **options: Unpack[SFTOptions],
    ) -> TrainResult:
        """Supervised fine-tuning on `trajectories` (any iterable, read once), then one step."""
        config = resolve_sft(options, BACKEND)
        listed = trajectory_list(trajectories, f"{BACKEND}.train_sft()")
        preflight_sft(BACKEND, self.capabilities, config)
        client = self.client(model)
        batches = sft_batches(listed, config)  # bad input fails before any update
        return await self._step(
            model,
            lambda: train_sft_batches(client, batches, config, num_trajectories=len(listed)),
            config.save_checkpoint,
        )

    async def _step(
        self, model: TrainableModel, run: Callable[[], Awaitable[StepMetrics]], save: bool
    ) -> TrainResult:
        """The updates of the next step, its published weights, its checkpoint, and only then
        the model's step: a failure puts the service's weights and optimizer back to the last
        indexed checkpoint (and publishes those)."""
        step = model.step + 1
        try:
            metrics = await run()
            if id(model) in self._published:  # served OpenAI-style: publish the new weights
                await self._publish(model, step)
            path = await self._save(model, step) if save else None
        except Exception as exc:
            await self._restore(model, exc)
            raise
        model.set_step(step)
        return TrainResult(step=step, metrics=metrics.as_dict(), checkpoint_path=path)

    async def _restore(self, model: TrainableModel, error: Exception) -> None:
        latest = latest_checkpoint(model.directory)
        if latest is None or int(latest["step"]) != model.step:
            error.add_note(
                f"model {model.name!r} stays at step {model.step}, but no checkpoint of that step "
                "is indexed, so its weights on the service may include part of the failed step; "
                "register the model again to start from its latest checkpoint or base model"
            )
            return
        try:  # a fresh client from the checkpoint (the SDK retires load_state on live ones)
            old = self.client(model)
            training = await self.service_client().create_training_client_from_state_with_optimizer(
                latest["path"]
            )
            self._clients[id(model)] = TinkerTrainingClient(training, old.get_tokenizer())
            old.close()
        except Exception as reload_error:
            error.add_note(
                f"reloading {latest['path']} after the failure failed too: {reload_error!r}"
            )
            return
        await self._release(old.sdk_client)  # the failed step's model, a full copy on the server
        if id(model) in self._published:
            try:  # the published weights may be the failed step's: publish the restored ones
                await self._publish(model, model.step)
            except Exception as publish_error:
                del self._published[id(model)]  # the next openai_endpoint() publishes again
                error.add_note(f"publishing the restored weights failed: {publish_error!r}")

    async def _release(self, training: Any) -> None:
        """Free a training client's model on the server now rather than when the session ends
        (on posttrain serve each is a full copy of the base model). Only self-hosted servers
        have the route; the Tinker service frees models with the session. A failure is logged:
        the model still goes when the session ends."""
        base_url = self.base_url or os.environ.get("TINKER_BASE_URL")
        api_key = self.api_key or os.environ.get("TINKER_API_KEY")
        if not base_url or not api_key:
            return
        try:
            await unload_model(base_url, api_key, str(training.model_id))
        except Exception as exc:
            log.warning("could not free model %s on %s: %r", training.model_id, base_url, exc)

    async def checkpoint(self, model: TrainableModel) -> str:
        """Save the model's current weights and optimizer on the service, and index them."""
        return await self._save(model, model.step)

    async def _save(self, model: TrainableModel, step: int) -> str:
        """Save weights and optimizer on the service; index the path with the trainer state.

        A checkpoint already saved under this step's name belongs to an attempt that failed
        before indexing it (indexed steps are <= the model's step), so it is overwritten.
        """
        saved = await self.client(model).save_state(f"step-{step:06d}", overwrite=True)
        record = {
            "step": step,
            "path": saved.path,
            "run_state": model.run_state,
            "model": model.config_dict(),
        }
        append_index(model.directory, record)
        return saved.path

    def sampling_client(self, model: TrainableModel) -> SamplingClient:
        client = self.client(model)
        return SamplingClient(client, client.get_tokenizer())

    def openai_endpoint(self, model: TrainableModel) -> OpenAIEndpoint:
        """The model's latest weights, OpenAI-style, from the `posttrain serve` it trains on.

        The weights are saved as the model's sampler checkpoint named `openai`, which the
        server's `/v1` endpoints serve under its `tinker://` path. The first call saves (and
        blocks for that round trip); from then on every train step overwrites it before the
        step counts, and the server serves the new weights under the same name. The name
        changes only when the model moves to a new training client (after a failed step or a
        new `register`), so read `model.inference_model_name` after each step.
        """
        self.client(model)  # the clear "not registered" error
        base_url = self.base_url or os.environ.get("TINKER_BASE_URL")
        if not base_url:
            raise NotImplementedError(
                f"{BACKEND} serves OpenAI-compatible sampling only from a `posttrain serve` "
                "server: pass TinkerBackend(base_url=...) (or set TINKER_BASE_URL)"
            )
        api_key = self.api_key or os.environ.get("TINKER_API_KEY")
        if not api_key:
            raise ValueError(f"{BACKEND} needs an API key: pass api_key= or set TINKER_API_KEY")
        published = self._published.get(id(model))
        if published is None or published[0] != model.step:
            path = self.client(model).save_weights_for_sampler(OPENAI_NAME).result()
            published = (model.step, path.path)
            self._published[id(model)] = published
        return OpenAIEndpoint(base_url.rstrip("/") + "/v1", api_key, published[1])

    async def _publish(self, model: TrainableModel, step: int) -> None:
        """Overwrite the model's `openai` sampler checkpoint with its current weights."""
        saved = await self.client(model).save_weights_for_sampler(OPENAI_NAME)
        self._published[id(model)] = (step, saved.path)

    async def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        self._published.clear()
        if self._service is not None:
            service, self._service = self._service, None
            await asyncio.to_thread(_close_service, service)


def resolve_tinker_rl(options: Mapping[str, object]) -> RLConfig:
    """RLConfig from TinkerBackend.train() options: unknown options are a TypeError, and a loss
    posttrain does not send over the protocol a ValueError, both before any work."""
    config = resolve_rl(options, TinkerRLOptions, BACKEND)
    losses = get_args(ProtocolPolicyLoss)
    if config.policy_loss not in losses:
        raise ValueError(
            f"{BACKEND}.train(): loss={config.policy_loss!r} is not carried by the Tinker protocol as "
            f"posttrain sends it; choose loss from {list(losses)}, or train with LocalBackend or "
            "RayBackend for dro and gspo"
        )
    return config


def _close_service(service: Any) -> None:
    close = getattr(service, "close", None)
    if close is not None:
        close("success").result()


def load_tokenizer(base_model: str) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base_model)


def read_index(directory: Path) -> list[dict[str, Any]]:
    index = directory / INDEX
    if not index.exists():
        return []
    records = []
    for line in index.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a crash: the checkpoints before it still count
    return records


def latest_checkpoint(directory: Path) -> dict[str, Any] | None:
    records = read_index(directory)
    return max(records, key=lambda r: int(r["step"])) if records else None


def resume_record(
    directory: Path, resume_step: int | None
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The index record to resume from (None: a fresh model) and the records after it.

    Without `resume_step`, the latest; with it, the last record of that step (0 with none:
    the base model). Records of later steps are set aside once the registration succeeds.
    """
    records = read_index(directory)
    if resume_step is None:
        return (max(records, key=lambda r: int(r["step"])) if records else None), []
    chosen = [r for r in records if int(r["step"]) == resume_step]
    if not chosen and resume_step != 0:
        steps = sorted({int(r["step"]) for r in records})
        raise ValueError(
            f"resume_step={resume_step}: {directory / INDEX} has no checkpoint of that step "
            f"(steps there: {steps or 'none'}); pick one of them, or 0 for the base model"
        )
    later = [r for r in records if int(r["step"]) > resume_step]
    return (chosen[-1] if chosen else None), later


def set_aside_records(
    directory: Path, later: list[dict[str, Any]], resume_step: int | None
) -> None:
    """Move the index records after an explicit `resume_step` to a file of their own (kept,
    like LocalBackend's set-aside step directories), so the steps trained from there on are
    the index's latest. The index is rewritten atomically."""
    if not later:
        return
    stamp = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
    aside = directory / f"checkpoints.set-aside-after-step-{resume_step}-{stamp}.jsonl"
    aside.write_text("".join(json.dumps(r) + "\n" for r in later))
    kept = [r for r in read_index(directory) if r not in later]
    tmp = directory / f".{INDEX}.tmp-{uuid.uuid4().hex}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / INDEX)


def append_index(directory: Path, record: dict[str, Any]) -> None:
    """Append one line and fsync: a crash leaves the earlier lines intact."""
    with open(directory / INDEX, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
