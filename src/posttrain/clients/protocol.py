"""The TrainingClient protocol: Tinker's primitives, implemented locally, on Ray, or remotely.

Beside it, small optional protocols name what only some clients offer, so shared code asks
`isinstance(client, ReferenceScorer)` instead of probing for a method by name.

A loss's configuration travels as a `LossConfig` (what the shared trainer passes). Code written
for the tinker SDK may pass Tinker's `loss_fn_config` mapping instead: `as_loss_config` parses
it with `LossConfig.from_mapping`, the one reader of that vocabulary.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from posttrain.algo.losses import LossConfig
from posttrain.clients.custom_loss import CustomLossFn
from posttrain.clients.futures import APIFuture
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

LossConfigValue = float | str | bool | None
LossFnConfig = LossConfig | Mapping[str, LossConfigValue]


def as_loss_config(loss_fn: str, config: LossFnConfig | None) -> LossConfig:
    """`config` as a LossConfig: itself, the default for None, or a parsed Tinker mapping."""
    if isinstance(config, LossConfig):
        return config
    return LossConfig.from_mapping(config or {}, loss_fn)


@dataclass(frozen=True)
class SaveWeightsResponse:
    """Where a checkpoint was written (a directory, or a tinker:// path on a remote service)."""

    path: str


@dataclass(frozen=True)
class LoadWeightsResponse:
    path: str


@runtime_checkable
class TrainingClient(Protocol):
    """Calls return futures and run in submission order; gradients accumulate until optim_step."""

    def forward(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: LossFnConfig | None = None,
    ) -> APIFuture[ForwardBackwardOutput]: ...

    def forward_backward(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: LossFnConfig | None = None,
    ) -> APIFuture[ForwardBackwardOutput]: ...

    def optim_step(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]: ...

    def sample(
        self, prompt: ModelInput, num_samples: int, sampling_params: SamplingParams
    ) -> APIFuture[SampleResponse]: ...

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]: ...

    def save_state(self, name: str) -> APIFuture[SaveWeightsResponse]: ...

    def load_state(
        self, path: str, with_optimizer: bool = False
    ) -> APIFuture[LoadWeightsResponse]: ...

    def save_weights_for_sampler(self, name: str) -> APIFuture[SaveWeightsResponse]: ...

    def get_tokenizer(self) -> Tokenizer: ...

    def close(self) -> None:
        """Finish the calls already made, then let go of what the client holds."""
        ...


@runtime_checkable
class CustomLossClient(Protocol):
    """A client that runs a loss on the logprobs (Tinker's `forward_backward_custom`)."""

    def forward_backward_custom(
        self, data: Sequence[Datum], loss_fn: CustomLossFn
    ) -> APIFuture[ForwardBackwardOutput]: ...


@runtime_checkable
class ReferenceScorer(Protocol):
    """A client that scores datums under the reference policy (the base model), for KL."""

    def reference_logprobs(self, data: Sequence[Datum]) -> APIFuture[list[list[float]]]: ...


@runtime_checkable
class BatchSampler(Protocol):
    """A client that samples several prompts in one batched call (posttrain's extension)."""

    def sample_many(
        self, prompts: Sequence[ModelInput], num_samples: int, sampling_params: SamplingParams
    ) -> Awaitable[list[SampleResponse]]: ...


@runtime_checkable
class ExportsWeights(Protocol):
    """A client that hands over its trainable weights, whole, for an engine to load."""

    def trainable_weights(self) -> APIFuture[dict[str, torch.Tensor]]:
        """Rank 0's trainable tensors by name, on the CPU, after the calls made before."""
        ...


@runtime_checkable
class LogprobChunking(Protocol):
    """A client whose workers compute logprobs in chunks of a size the caller sets."""

    def set_logprob_chunk_size(self, chunk_size: int) -> None: ...


@runtime_checkable
class Packing(Protocol):
    """A client whose workers can pack datums into rows, each attending only to itself
    (`engine.packing`); results are those of the unpacked pass."""

    def set_packing(self, packing: bool) -> None: ...


class SavesTrainerState(Protocol):
    """A client that saves JSON trainer state inside its checkpoint files, for exact resume."""

    def save_state(
        self, name: str, trainer_state: Mapping[str, object] | None = None
    ) -> APIFuture[SaveWeightsResponse]: ...
