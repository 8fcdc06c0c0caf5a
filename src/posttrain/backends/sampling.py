"""`ModelSampler`: what `backend.sampling_client(model)` returns, used by rollout code.

It samples a registered model's latest weights through the model's TrainingClient. Named apart
from Tinker's `SamplingClient` (a client on fixed saved weights, `LocalSamplingClient` here).
"""

from __future__ import annotations

from collections.abc import Sequence

from posttrain.clients.protocol import BatchSampler, TrainingClient
from posttrain.tokenizer import Tokenizer
from posttrain.types import ModelInput, SampleResponse, SamplingParams


class ModelSampler:
    """Samples from the weights the model has now (after the latest `train` call)."""

    def __init__(self, client: TrainingClient, tokenizer: Tokenizer) -> None:
        self._client = client
        self.tokenizer = tokenizer

    @property
    def client(self) -> TrainingClient:
        """The training client it samples (the model's identity for batching requests)."""
        return self._client

    async def sample(
        self, prompt: ModelInput | Sequence[int], num_samples: int, params: SamplingParams
    ) -> SampleResponse:
        model_input = prompt if isinstance(prompt, ModelInput) else ModelInput.from_ints(prompt)
        return await self._client.sample(model_input, num_samples, params)

    async def sample_many(
        self,
        prompts: Sequence[ModelInput | Sequence[int]],
        num_samples: int,
        params: SamplingParams,
    ) -> list[SampleResponse]:
        """Several prompts in one batched call where the client supports it."""
        inputs = [p if isinstance(p, ModelInput) else ModelInput.from_ints(p) for p in prompts]
        if isinstance(self._client, BatchSampler):
            return await self._client.sample_many(inputs, num_samples, params)
        return [await self._client.sample(p, num_samples, params) for p in inputs]

    async def compute_logprobs(self, prompt: ModelInput | Sequence[int]) -> list[float | None]:
        model_input = prompt if isinstance(prompt, ModelInput) else ModelInput.from_ints(prompt)
        return await self._client.compute_logprobs(model_input)
