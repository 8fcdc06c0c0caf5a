"""LocalTrainingClient: the TrainingClient protocol over a `Dispatch` of workers.

The workers are in this process (`InProcessExecutor`), or Ray actors: a RayTrainingClient
holds one of these over its `RayExecutor` and adds what only Ray has.
"""

from __future__ import annotations

import re
import shutil
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import torch

from posttrain.algo.loss_metrics import summarize_values
from posttrain.algo.losses import LossConfig
from posttrain.clients import spill as on_disk
from posttrain.clients.custom_loss import (
    CustomLossFn,
    custom_gradients,
    custom_output,
    forward_data,
)
from posttrain.clients.futures import APIFuture, OrderedRunner
from posttrain.clients.local_sampling import (
    LocalSamplingClient,
    ReplicaPool,
    load_replica,
    snapshot_replica,
)
from posttrain.clients.protocol import (
    LoadWeightsResponse,
    LossFnConfig,
    SaveWeightsResponse,
    as_loss_config,
)
from posttrain.engine.compute_thread import ComputeThread
from posttrain.engine.decode.sampler import Sampler
from posttrain.engine.dispatch import Dispatch
from posttrain.engine.executor import InProcessExecutor
from posttrain.engine.worker import PassResult, Worker
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

T = TypeVar("T")
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def _check_name(name: str) -> str:
    if not _NAME.match(name) or name in {".", ".."}:
        raise ValueError(
            f"checkpoint name {name!r} is not allowed: use letters, digits, '.', '_' and '-'"
        )
    return name


def to_output(result: PassResult) -> ForwardBackwardOutput:
    """Per datum its logprobs, and its entropies where the model has them (a critic has none)."""
    metrics = {"loss:sum": result.loss_sum, "tokens:sum": float(result.num_tokens)}
    metrics.update(summarize_values(result.diagnostics))
    outputs: list[dict[str, torch.Tensor]] = [{"logprobs": lp} for lp in result.logprobs]
    if result.entropies is not None:
        for output, entropy in zip(outputs, result.entropies, strict=True):
            output["entropy"] = entropy
    return ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord", loss_fn_outputs=outputs, metrics=metrics
    )


class LocalTrainingClient:
    """Runs Tinker's primitives on workers in this process, one call at a time, in order."""

    def __init__(
        self,
        dispatch: Dispatch,
        *,
        storage_dir: str | Path,
        base_model: str = "",
        worker_factory: Callable[[], Worker] | None = None,
        compute_thread: ComputeThread | None = None,
    ) -> None:
        self.dispatch = dispatch
        self.storage_dir = Path(storage_dir)
        self.base_model = base_model
        # Builds a fresh replica of the base model (same LoRA settings) for sampling clients.
        self.worker_factory = worker_factory
        # Calls run on `compute_thread` when given (shared with other clients), else on a
        # thread of the client's own.
        self._runner = OrderedRunner("posttrain-local", compute_thread)
        self._replicas = ReplicaPool()  # idle snapshot replicas, reused by the next snapshot

    def forward(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: LossFnConfig | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        config = as_loss_config(loss_fn, loss_fn_config)
        data = list(data)
        return self._runner.submit(lambda: to_output(self.dispatch.forward(data, loss_fn, config)))

    def forward_backward(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: LossFnConfig | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        config = as_loss_config(loss_fn, loss_fn_config)
        data = list(data)
        return self._runner.submit(
            lambda: to_output(self.dispatch.forward_backward(data, loss_fn, config))
        )

    def forward_backward_custom(
        self, data: Sequence[Datum], loss_fn: CustomLossFn
    ) -> APIFuture[ForwardBackwardOutput]:
        """Tinker's custom loss (`clients.custom_loss`): forward, `loss_fn` on the logprobs,
        backward through their gradient, as one call in order. A loss refused there leaves the
        gradients as they were."""
        data = list(data)

        def run() -> ForwardBackwardOutput:
            forward = self.dispatch.forward(forward_data(data), "cross_entropy", LossConfig())
            custom = custom_gradients(data, loss_fn, forward.logprobs)
            backward = self.dispatch.forward_backward(custom.data, "cross_entropy", LossConfig())
            return custom_output(to_output(backward), custom)

        return self._runner.submit(run)

    def optim_step(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]:
        return self._runner.submit(lambda: OptimStepResponse(self.dispatch.optim_step(adam_params)))

    def sample(
        self, prompt: ModelInput, num_samples: int, sampling_params: SamplingParams
    ) -> APIFuture[SampleResponse]:
        tokens = prompt.to_ints()
        return self._runner.submit(
            lambda: self.dispatch.sample([tokens], num_samples, sampling_params)[0]
        )

    def sample_many(
        self, prompts: Sequence[ModelInput], num_samples: int, sampling_params: SamplingParams
    ) -> APIFuture[list[SampleResponse]]:
        """Sample several prompts in one batched call (posttrain's extension)."""
        tokens = [p.to_ints() for p in prompts]
        return self._runner.submit(
            lambda: self.dispatch.sample(tokens, num_samples, sampling_params)
        )

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]:
        tokens = prompt.to_ints()
        return self._runner.submit(lambda: self.dispatch.compute_logprobs(tokens))

    def reference_logprobs(self, data: Sequence[Datum]) -> APIFuture[list[list[float]]]:
        """Target logprobs under the reference policy (base model), for KL penalties."""
        data = list(data)
        return self._runner.submit(lambda: self.dispatch.reference_logprobs(data))

    def save_state(
        self, name: str, trainer_state: Mapping[str, object] | None = None
    ) -> APIFuture[SaveWeightsResponse]:
        """Weights, optimizer and RNG state under `<storage>/checkpoints/<name>`, atomically.

        `trainer_state` (posttrain's extension) is JSON saved beside them, for exact resume.
        """
        path = self.storage_dir / "checkpoints" / _check_name(name)
        state = dict(trainer_state or {})
        return self._runner.submit(
            lambda: SaveWeightsResponse(str(self.dispatch.save_state(path, True, state)))
        )

    def load_state(self, path: str, with_optimizer: bool = False) -> APIFuture[LoadWeightsResponse]:
        return self._runner.submit(
            lambda: LoadWeightsResponse(
                str(self.dispatch.load_state(Path(path), with_optimizer=with_optimizer))
            )
        )

    def load_state_with_optimizer(self, path: str) -> APIFuture[LoadWeightsResponse]:
        return self.load_state(path, with_optimizer=True)

    def save_weights_for_sampler(self, name: str) -> APIFuture[SaveWeightsResponse]:
        """Publish the current weights under `<storage>/sampler_weights/<name>`; give the path
        to `create_sampling_client`."""
        path = self.storage_dir / "sampler_weights" / _check_name(name)
        return self._runner.submit(
            lambda: SaveWeightsResponse(str(self.dispatch.save_weights(path)))
        )

    def create_sampling_client(self, model_path: str) -> APIFuture[LocalSamplingClient]:
        """A sampling client on the weights saved at `model_path` (sampler weights or state)."""
        factory = self._factory()
        return self._runner.submit(
            lambda: LocalSamplingClient.load(factory, model_path, base_model=self.base_model)
        )

    def save_weights_and_get_sampling_client(self) -> APIFuture[LocalSamplingClient]:
        """A sampling client on a snapshot of the weights as of this call (in call order);
        later training does not change what it samples.

        Weights held in this process are copied straight into the replica; workers elsewhere
        (Ray) publish them to ephemeral files the replica reads. Either way the replica is the
        one a closed (or dropped) snapshot client left, when there is one.
        """
        worker = self._in_process_worker()
        if worker is not None:
            return self._runner.submit(
                lambda: self._snapshot_client(snapshot_replica(worker, self._replicas.take()))
            )
        factory = self._factory()

        def published() -> LocalSamplingClient:
            path = self.storage_dir / "sampler_weights" / f".ephemeral-{uuid.uuid4().hex}"
            try:
                self.dispatch.save_weights(path)
                return self._snapshot_client(load_replica(factory, path, self._replicas.take()))
            finally:
                shutil.rmtree(path, ignore_errors=True)  # the replica holds the weights now

        return self._runner.submit(published)

    def _snapshot_client(self, replica: Sampler) -> LocalSamplingClient:
        # A snapshot lives in memory only: it has no model_path to give.
        return LocalSamplingClient(
            replica, base_model=self.base_model, model_path="", release=self._replicas.give_back
        )

    def _in_process_worker(self) -> Worker | None:
        """Rank 0's worker when the workers live in this process (replicas are all equal)."""
        executor = self.dispatch.executor
        return executor.workers[0] if isinstance(executor, InProcessExecutor) else None

    def sampling_worker(self) -> Worker | None:
        """The one worker of a single-worker client in this process, its state placed for
        sampling (None otherwise): for a caller that runs several clients' models in one
        batch (`clients.shared_decode`). Call it where this client's calls run (its compute
        thread), not concurrently with them."""
        worker = self._in_process_worker()
        if worker is None or self.dispatch.num_workers != 1:
            return None
        self.dispatch.prepare("sample", "sample")
        return worker

    def spill(self, path: Path) -> None:
        """Write the whole state the next results depend on (adapter, AdamW state, accumulated
        gradients) to `path`, atomically (`clients.spill`). Call it where this client's calls
        run, not concurrently with them."""
        on_disk.spill(self.dispatch, path)

    def restore(self, path: Path) -> None:
        """Load what `spill` wrote into this fresh client of the same LoRA settings."""
        on_disk.restore(self.dispatch, path)

    def _factory(self) -> Callable[[], Worker]:
        if self.worker_factory is None:
            raise ValueError(
                "this client has no worker_factory to build sampling replicas with; "
                "create it with posttrain.create_training_client"
            )
        return self.worker_factory

    def offload(self) -> APIFuture[None]:
        """Park weights, gradients and optimizer state on the CPU (in call order); the next
        call that needs them brings them back. Frees the device for another engine."""
        return self._runner.submit(self.dispatch.offload)

    def trainable_weights(self) -> APIFuture[dict[str, torch.Tensor]]:
        """Rank 0's trainable tensors by name, whole (gathered when sharded), on the CPU."""

        def gather() -> dict[str, torch.Tensor]:
            tensors = self.dispatch.executor.full_tensors("weights")[0]
            return {name: t for name, t in tensors.items() if t is not None}

        return self._runner.submit(gather)

    def set_logprob_chunk_size(self, chunk_size: int) -> None:
        """Tokens per chunk of the logprob computation on every worker (from the next call)."""
        if chunk_size < 1:
            raise ValueError(f"logprob chunk size must be >= 1, got {chunk_size}")
        self._runner.submit(lambda: self.dispatch.set_logprob_chunk_size(chunk_size)).result()

    def set_packing(self, packing: bool) -> None:
        """Whether every worker packs the datums of the next calls (`engine.packing`)."""
        self._runner.submit(lambda: self.dispatch.set_packing(packing)).result()

    def get_tokenizer(self) -> Tokenizer:
        tokenizer = self.dispatch.tokenizer
        if tokenizer is None:  # only a checkpoint-only replica is built without one
            raise RuntimeError("this client's workers were built without a tokenizer")
        return tokenizer

    def submit(self, fn: Callable[[], T]) -> APIFuture[T]:
        """Run `fn` in call order with this client's calls (for a client that wraps this one)."""
        return self._runner.submit(fn)

    def close(self) -> None:
        self._runner.close()
        self._replicas.close()
