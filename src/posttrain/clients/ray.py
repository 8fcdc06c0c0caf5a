"""RayTrainingClient: the TrainingClient protocol over Ray actor workers (data parallel)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from posttrain.clients.custom_loss import CustomLossFn
from posttrain.clients.futures import APIFuture
from posttrain.clients.local import LocalTrainingClient
from posttrain.clients.local_sampling import LocalSamplingClient
from posttrain.clients.protocol import LoadWeightsResponse, LossFnConfig, SaveWeightsResponse
from posttrain.engine.dispatch import Dispatch
from posttrain.engine.ray.executor import RayExecutor
from posttrain.engine.worker import Worker
from posttrain.tokenizer import Tokenizer
from posttrain.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    ModelInput,
    OptimStepResponse,
    SampleResponse,
    SamplingParams,
)


class RayTrainingClient:
    """The primitives of a LocalTrainingClient whose `Dispatch` runs on a `RayExecutor`'s actors.

    It holds that client (`core`) and passes each call to it, so results match the local
    client's; what it adds is Ray's: a check that the workers see `storage_dir` as this process
    does, `weight_digests`, and a `close()` that also frees the actors and the local Ray it
    started. Sampling clients hold their replica in this process, built by `worker_factory`.

    `storage_dir` is where rank 0 writes checkpoints and exported weights and where they are
    loaded from. On a cluster it must be storage the workers' nodes mount at the same path:
    otherwise (`executor.check_storage`) this raises StorageNotShared and frees the actors,
    before anything could be written where this process never sees it.
    """

    def __init__(
        self,
        executor: RayExecutor,
        *,
        storage_dir: str | Path,
        base_model: str = "",
        worker_factory: Callable[[], Worker] | None = None,
    ) -> None:
        self.executor = executor
        storage = Path(storage_dir).absolute()  # the workers' working directory is not ours
        try:
            executor.check_storage(storage)
        except BaseException:
            executor.close()
            raise
        self.core = LocalTrainingClient(
            Dispatch(executor),
            storage_dir=storage,
            base_model=base_model,
            worker_factory=worker_factory,
        )

    @property
    def dispatch(self) -> Dispatch:
        return self.core.dispatch

    @property
    def storage_dir(self) -> Path:
        return self.core.storage_dir

    @property
    def base_model(self) -> str:
        return self.core.base_model

    def forward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: LossFnConfig | None = None
    ) -> APIFuture[ForwardBackwardOutput]:
        return self.core.forward(data, loss_fn, loss_fn_config)

    def forward_backward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: LossFnConfig | None = None
    ) -> APIFuture[ForwardBackwardOutput]:
        return self.core.forward_backward(data, loss_fn, loss_fn_config)

    def forward_backward_custom(
        self, data: Sequence[Datum], loss_fn: CustomLossFn
    ) -> APIFuture[ForwardBackwardOutput]:
        return self.core.forward_backward_custom(data, loss_fn)

    def optim_step(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]:
        return self.core.optim_step(adam_params)

    def sample(
        self, prompt: ModelInput, num_samples: int, sampling_params: SamplingParams
    ) -> APIFuture[SampleResponse]:
        return self.core.sample(prompt, num_samples, sampling_params)

    def sample_many(
        self, prompts: Sequence[ModelInput], num_samples: int, sampling_params: SamplingParams
    ) -> APIFuture[list[SampleResponse]]:
        return self.core.sample_many(prompts, num_samples, sampling_params)

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]:
        return self.core.compute_logprobs(prompt)

    def reference_logprobs(self, data: Sequence[Datum]) -> APIFuture[list[list[float]]]:
        return self.core.reference_logprobs(data)

    def save_state(
        self, name: str, trainer_state: Mapping[str, object] | None = None
    ) -> APIFuture[SaveWeightsResponse]:
        """Rank 0 writes the checkpoint under `storage_dir` (see LocalTrainingClient.save_state)."""
        return self.core.save_state(name, trainer_state)

    def load_state(self, path: str, with_optimizer: bool = False) -> APIFuture[LoadWeightsResponse]:
        return self.core.load_state(path, with_optimizer)

    def load_state_with_optimizer(self, path: str) -> APIFuture[LoadWeightsResponse]:
        return self.core.load_state(path, with_optimizer=True)

    def save_weights_for_sampler(self, name: str) -> APIFuture[SaveWeightsResponse]:
        return self.core.save_weights_for_sampler(name)

    def create_sampling_client(self, model_path: str) -> APIFuture[LocalSamplingClient]:
        return self.core.create_sampling_client(model_path)

    def save_weights_and_get_sampling_client(self) -> APIFuture[LocalSamplingClient]:
        """As the local client's: rank 0's actor writes the snapshot under `storage_dir`,
        which this process sees (checked when the client was made), and reads it."""
        return self.core.save_weights_and_get_sampling_client()

    def offload(self) -> APIFuture[None]:
        return self.core.offload()

    def set_logprob_chunk_size(self, chunk_size: int) -> None:
        self.core.set_logprob_chunk_size(chunk_size)

    def set_packing(self, packing: bool) -> None:
        self.core.set_packing(packing)

    def get_tokenizer(self) -> Tokenizer:
        return self.core.get_tokenizer()

    def trainable_weights(self) -> APIFuture[dict[str, torch.Tensor]]:
        """Rank 0's trainable tensors by name, whole, on this process's CPU."""
        return self.core.trainable_weights()

    def weight_digests(self) -> APIFuture[list[str]]:
        """A digest of each rank's trainable weights (all equal while replicas are in sync)."""
        return self.core.submit(self.executor.weight_digests)

    def close(self) -> None:
        self.core.close()
        self.executor.close()
