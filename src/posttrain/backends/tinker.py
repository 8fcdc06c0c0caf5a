"""TinkerBackend: the backend-first API over the official `tinker` SDK.

It runs the shared model lifecycle (`backends.client_models`) and trainer against a
TinkerTrainingClient, so it works against the Tinker service and against `posttrain serve`
alike. Its options are what Tinker's wire protocol can carry (`RLOptions`, `SFTOptions`);
anything else is a pyright error and a TypeError.

What is Tinker's own lives here: the SDK's service client, which makes and reloads the models
(`TinkerClients`); checkpoints on the service (`tinker://...` paths), indexed with their trainer
state in the model directory's `checkpoints.jsonl` (`backends.tinker_index`); and publishing
the weights for OpenAI-style sampling from `posttrain serve`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Unpack, get_args

from posttrain.algo.advantages import GroupEstimator
from posttrain.algo.config_fields import option
from posttrain.algo.ratios import ImportanceSamplingLevel
from posttrain.backends.capabilities import Capabilities
from posttrain.backends.client_models import ModelClients
from posttrain.backends.model import OpenAIEndpoint, TrainableModel
from posttrain.backends.options import (
    CoreRLFields,
    RemoteDPOOptions,
    SFTOptions,
    check_options,
    document,
    resolve_dpo,
    resolve_sft,
)
from posttrain.backends.register_checks import model_problems, preflight_register
from posttrain.backends.tinker_index import JsonlCheckpoints
from posttrain.clients.tinker import TinkerTrainingClient, import_tinker, unload_model
from posttrain.data.preferences import PreferencePair
from posttrain.data.trajectories import Trajectory, TrajectoryGroup
from posttrain.inference.model_sampler import ModelSampler
from posttrain.models.source import resolve_model_source
from posttrain.tokenizer import Tokenizer
from posttrain.trainer.config import (
    LossName,
    PolicyLoss,
    ProtocolPolicyLoss,
    RLConfig,
    from_options,
    loss_name_problem,
)
from posttrain.types import TrainResult

BACKEND = "TinkerBackend"
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
    provides_token_entropies=False,  # the Tinker protocol's sampled sequences carry none
    supports_full_finetuning=False,  # the protocol creates LoRA training clients only
)


class TinkerRLOptions(CoreRLFields, total=False, closed=True):
    """TinkerBackend.train() options: what the Tinker protocol carries (`RLOptions`), and its
    own."""

    loss: ProtocolPolicyLoss | LossName
    advantage_estimator: GroupEstimator  # no critic ('gae') on the server
    # Through forward_backward_custom: posttrain's loss on the logprobs the server returns.
    importance_sampling_level: ImportanceSamplingLevel
    mask_prob_ratio: bool
    max_negative_advantage_importance_sampling_weight: float | None
    kimi_k2_tau: float | None
    deploy_checkpoint: bool


@dataclass(frozen=True)
class TinkerRLConfig(RLConfig):
    """Resolved TinkerBackend.train() options: RLConfig's plus TinkerBackend's own."""

    deploy_checkpoint: bool = option(
        False,
        "publish the step's weights for inference (a sampler checkpoint named step_<step>); "
        "TrainResult.artifact_name is its tinker:// path",
    )


document(TinkerRLOptions, TinkerRLConfig)


class TinkerBackend:
    """Train LoRA adapters on a Tinker-protocol server (the Tinker service or `posttrain serve`).

    `base_url=None` uses `$TINKER_BASE_URL` or the SDK's default service; `api_key=None` uses
    `$TINKER_API_KEY` (keys start with `tml-`).
    """

    capabilities: ClassVar[Capabilities] = TINKER
    rl_options: ClassVar[type] = TinkerRLOptions
    rl_config: ClassVar[type] = TinkerRLConfig
    sft_options: ClassVar[type] = SFTOptions
    dpo_options: ClassVar[type] = RemoteDPOOptions

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
        self._tinker = TinkerClients(base_url, api_key)
        self._models: ModelClients[TinkerTrainingClient] = ModelClients(
            path,
            backend=BACKEND,
            capabilities=self.capabilities,
            clients=self._tinker,
            index=JsonlCheckpoints(),
            after_update=self._publish_if_served,
            after_reload=self._republish,
        )
        # Models served through openai_endpoint: (step, tinker path of its sampler weights).
        self._published: dict[int, tuple[int, str]] = {}

    def service_client(self) -> Any:
        """The SDK's ServiceClient (created on first use; it connects lazily)."""
        return self._tinker.service()

    def model_dir(self, model: TrainableModel) -> Path:
        return self._models.model_dir(model)

    async def register(self, model: TrainableModel) -> None:
        """Create the model's LoRA on the service, or resume it from its latest checkpoint.

        The base model must be at hand here too (its tokenizer loads locally): checked first.
        A registration that fails after the service made the model frees it there, and leaves
        the model as it was (not attached, its run_state untouched).
        """
        for problem in model_problems(BACKEND, self.capabilities, model.lora_rank):
            raise ValueError(problem.message)
        await preflight_register(BACKEND, model)
        await self._models.register(self, model)

    def client(self, model: TrainableModel) -> TinkerTrainingClient:
        return self._models.client(model)

    async def train(
        self,
        model: TrainableModel,
        trajectory_groups: Iterable[TrajectoryGroup],
        **options: Unpack[TinkerRLOptions],
    ) -> TrainResult:
        """One RL step through the shared trainer on `trajectory_groups` (any iterable, read
        once); the loss runs on the server (a custom loss on the logprobs it returns)."""
        config = resolve_tinker_rl(options)
        result = await self._models.train(model, trajectory_groups, config)
        if not config.deploy_checkpoint:
            return result
        # After the step counted: its weights are the model's whether or not publishing works.
        saved = await self.client(model).save_weights_for_sampler(f"step_{result.step:05d}")
        return replace(result, artifact_name=saved.path, deployed=True)

    async def train_sft(
        self,
        model: TrainableModel,
        trajectories: Iterable[Trajectory],
        **options: Unpack[SFTOptions],
    ) -> TrainResult:
        """Supervised fine-tuning on `trajectories` (any iterable, read once), then one step."""
        return await self._models.train_sft(
            model, trajectories, resolve_sft(options, SFTOptions, BACKEND)
        )

    async def train_dpo(
        self,
        model: TrainableModel,
        pairs: Iterable[PreferencePair],
        **options: Unpack[RemoteDPOOptions],
    ) -> TrainResult:
        """DPO (or IPO) on preference `pairs` (any iterable, read once), then one step. The
        reference is the policy at the start of the call (the protocol has no base-model
        scoring): train_dpo right after SFT uses the SFT model, as in the DPO paper."""
        config = replace(resolve_dpo(options, RemoteDPOOptions, BACKEND), reference="initial")
        return await self._models.train_dpo(model, pairs, config)

    async def checkpoint(self, model: TrainableModel) -> str:
        """Save the model's current weights and optimizer on the service, and index them."""
        return await self._models.checkpoint(model)

    def sampling_client(self, model: TrainableModel) -> ModelSampler:
        return self._models.sampling_client(model)

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
        base_url = self._tinker.url()
        if not base_url:
            raise NotImplementedError(
                f"{BACKEND} serves OpenAI-compatible sampling only from a `posttrain serve` "
                "server: pass TinkerBackend(base_url=...) (or set TINKER_BASE_URL)"
            )
        api_key = self._tinker.key()
        if not api_key:
            raise ValueError(f"{BACKEND} needs an API key: pass api_key= or set TINKER_API_KEY")
        published = self._published.get(id(model))
        if published is None or published[0] != model.step:
            path = self.client(model).save_weights_for_sampler(OPENAI_NAME).result()
            published = (model.step, path.path)
            self._published[id(model)] = published
        return OpenAIEndpoint(base_url.rstrip("/") + "/v1", api_key, published[1])

    async def _publish_if_served(self, model: TrainableModel, step: int) -> None:
        """Inside each step of a model served OpenAI-style: overwrite its `openai` sampler
        checkpoint with the new weights (a failure fails the step)."""
        if id(model) in self._published:
            saved = await self.client(model).save_weights_for_sampler(OPENAI_NAME)
            self._published[id(model)] = (step, saved.path)

    async def _republish(self, model: TrainableModel, step: int) -> None:
        """After a failed step's reload: the published weights may be the failed step's, so
        publish the restored ones (from the new client, under its own name)."""
        try:
            await self._publish_if_served(model, step)
        except Exception as exc:
            del self._published[id(model)]  # the next openai_endpoint() publishes again
            raise RuntimeError(f"publishing the restored weights failed: {exc!r}") from exc

    async def close(self) -> None:
        await self._models.close()
        self._published.clear()
        await self._tinker.close()


class TinkerClients:
    """The `ClientSource` of TinkerBackend: models made, reloaded and freed on the service."""

    def __init__(self, base_url: str | None, api_key: str | None) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self._service: Any = None

    def url(self) -> str | None:
        return self.base_url or os.environ.get("TINKER_BASE_URL")

    def key(self) -> str | None:
        return self.api_key or os.environ.get("TINKER_API_KEY")

    def service(self) -> Any:
        """The SDK's ServiceClient (created on first use; it connects lazily)."""
        if self._service is None:
            tinker = import_tinker()
            self._service = tinker.ServiceClient(base_url=self.base_url, api_key=self.api_key)
        return self._service

    async def open(
        self, model: TrainableModel, directory: Path, checkpoint: str | None
    ) -> TinkerTrainingClient:
        """The tokenizer first (it loads here), then the service's model: a fresh LoRA, or one
        with `checkpoint`'s weights and optimizer."""
        tokenizer = await asyncio.to_thread(load_tokenizer, model.base_model)
        if checkpoint is None:
            training = await self.service().create_lora_training_client(
                model.base_model,
                rank=model.lora_rank,
                seed=model.seed,
                train_mlp=model.train_mlp,
                train_attn=model.train_attn,
                train_unembed=await asyncio.to_thread(wire_train_unembed, model),
            )
        else:
            training = await self.service().create_training_client_from_state_with_optimizer(
                checkpoint
            )
        return TinkerTrainingClient(training, tokenizer)

    async def reload(self, client: TinkerTrainingClient, checkpoint: str) -> TinkerTrainingClient:
        """A new client from the checkpoint (the SDK retires load_state on live ones)."""
        training = await self.service().create_training_client_from_state_with_optimizer(checkpoint)
        return TinkerTrainingClient(training, client.get_tokenizer())

    async def release(self, client: TinkerTrainingClient) -> None:
        """Close the client and free its model on the server now rather than when the session
        ends (on posttrain serve each is a full copy of the base model). Only self-hosted
        servers have the route; the Tinker service frees models with the session. A failure is
        logged: the model still goes when the session ends."""
        client.close()
        base_url, api_key = self.url(), self.key()
        if not base_url or not api_key:
            return
        model_id = str(client.sdk_client.model_id)
        try:
            await unload_model(base_url, api_key, model_id)
        except Exception as exc:
            log.warning("could not free model %s on %s: %r", model_id, base_url, exc)

    async def close(self) -> None:
        if self._service is not None:
            service, self._service = self._service, None
            await asyncio.to_thread(_close_service, service)


def resolve_tinker_rl(options: Mapping[str, object]) -> TinkerRLConfig:
    """TinkerRLConfig from TinkerBackend.train() options: unknown options are a TypeError, and
    a loss posttrain does not send over the protocol a ValueError, both before any work."""
    check_options(options, TinkerRLOptions, BACKEND)
    loss = options.get("loss")
    problem = (
        loss_name_problem(loss, get_args(ProtocolPolicyLoss)) if isinstance(loss, str) else None
    )
    if problem is not None:
        elsewhere = (
            f" ({loss!r} is not carried by the Tinker protocol as posttrain sends it: train it "
            "with LocalBackend or RayBackend)"
            if loss in get_args(PolicyLoss)
            else ""
        )
        raise ValueError(f"{BACKEND}.train(): {problem}{elsewhere}")
    return from_options(TinkerRLConfig, options)  # `ppo` alone means ppo or cispo, both carried


def _close_service(service: Any) -> None:
    close = getattr(service, "close", None)
    if close is not None:
        close("success").result()


def wire_train_unembed(model: TrainableModel) -> bool:
    """`train_unembed` as the Tinker wire takes it, a bool: None (the unembedding unless tied to
    the input embedding) is resolved from the base model's config, so that this backend adapts
    the layers LocalBackend does."""
    if model.train_unembed is not None:
        return model.train_unembed
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model.base_model).get_text_config()
    return not bool(getattr(config, "tie_word_embeddings", False))


def load_tokenizer(base_model: str) -> Tokenizer:
    """The base model's tokenizer, here: a .gguf or packaged base model is converted locally
    too (the server converts its own copy)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_source(base_model))
