"""A training client whose `optim_step` brings its own AdamW settings and learning-rate
schedule, around any TrainingClient (`posttrain.blocks.create_backend_with_scheduler` builds
one)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from posttrain.clients.custom_loss import CustomLossFn
from posttrain.clients.futures import APIFuture
from posttrain.clients.protocol import (
    CustomLossClient,
    LoadWeightsResponse,
    LossFnConfig,
    SaveWeightsResponse,
    TrainingClient,
)
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


class ScheduledTrainingClient:
    """A training client whose `optim_step` applies its own AdamW settings, the learning rate
    scaled by a schedule: step k (0-based, counted here) uses `learning_rate * schedule(k)`.
    `optim_step(adam_params)` scales the rate given instead, as LambdaLR scales a base rate.
    Set `steps` after loading a checkpoint to resume the schedule where it was.

    Every other call goes to `client`: the TrainingClient and CustomLossClient methods by name
    (so pyright checks them against the protocols), and anything else the client has
    (`save_weights_and_get_sampling_client`, `sample_many`, ...) through `__getattr__`, so
    none can be left out."""

    def __init__(
        self,
        client: TrainingClient,
        adam: AdamParams,
        schedule: Callable[[int], float] | None = None,
    ) -> None:
        self.client = client
        self.adam = adam
        self.schedule = schedule or (lambda _step: 1.0)
        self.steps = 0

    @property
    def learning_rate(self) -> float:
        """The rate the next `optim_step()` applies."""
        return self.adam.learning_rate * self.schedule(self.steps)

    def optim_step(self, adam_params: AdamParams | None = None) -> APIFuture[OptimStepResponse]:
        base = adam_params or self.adam
        rate = base.learning_rate * self.schedule(self.steps)
        self.steps += 1
        return self.client.optim_step(replace(base, learning_rate=rate))

    def forward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: LossFnConfig | None = None
    ) -> APIFuture[ForwardBackwardOutput]:
        return self.client.forward(data, loss_fn, loss_fn_config)

    def forward_backward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: LossFnConfig | None = None
    ) -> APIFuture[ForwardBackwardOutput]:
        return self.client.forward_backward(data, loss_fn, loss_fn_config)

    def forward_backward_custom(
        self, data: Sequence[Datum], loss_fn: CustomLossFn
    ) -> APIFuture[ForwardBackwardOutput]:
        if not isinstance(self.client, CustomLossClient):
            raise TypeError(f"{type(self.client).__name__} has no forward_backward_custom")
        return self.client.forward_backward_custom(data, loss_fn)

    def sample(
        self, prompt: ModelInput, num_samples: int, sampling_params: SamplingParams
    ) -> APIFuture[SampleResponse]:
        return self.client.sample(prompt, num_samples, sampling_params)

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]:
        return self.client.compute_logprobs(prompt)

    def save_state(self, name: str) -> APIFuture[SaveWeightsResponse]:
        return self.client.save_state(name)

    def load_state(self, path: str, with_optimizer: bool = False) -> APIFuture[LoadWeightsResponse]:
        return self.client.load_state(path, with_optimizer)

    def save_weights_for_sampler(self, name: str) -> APIFuture[SaveWeightsResponse]:
        return self.client.save_weights_for_sampler(name)

    def get_tokenizer(self) -> Tokenizer:
        return self.client.get_tokenizer()

    def close(self) -> None:
        self.client.close()

    def __getattr__(self, name: str) -> Any:
        """What the wrapped client has beyond the protocols (called only for names not found
        here; `client` itself is looked up in __dict__, so an unpickled copy cannot recurse)."""
        client = self.__dict__.get("client")
        if client is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(client, name)
