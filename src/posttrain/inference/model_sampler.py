"""`ModelSampler`: what `backend.sampling_client(model)` returns, used by rollout code.

It samples a registered model's latest weights through the model's sampling engine (by
default the TrainingClient itself; see `posttrain.inference`) and scores prompts through the
TrainingClient. Named apart from Tinker's `SamplingClient` (a client on fixed saved weights,
`LocalSamplingClient` here).
"""

from __future__ import annotations

from collections.abc import Sequence

from posttrain.clients.protocol import TrainingClient
from posttrain.inference.live import LiveEngine
from posttrain.inference.protocol import SamplingEngine
from posttrain.tokenizer import Tokenizer
from posttrain.types import ModelInput, SampleResponse, SamplingParams


class ModelSampler:
    """Samples from the weights the model has now (after the latest `train` call)."""

    def __init__(
        self, client: TrainingClient, tokenizer: Tokenizer, *, engine: SamplingEngine | None = None
    ) -> None:
        self._client = client
        self.tokenizer = tokenizer
        self.engine: SamplingEngine = engine or LiveEngine(client)

    @property
    def policy_version(self) -> int:
        """The model step whose weights the next sample uses."""
        return self.engine.version

    @property
    def client(self) -> TrainingClient:
        """The training client it samples (the model's identity for batching requests)."""
        return self._client

    async def sample(
        self, prompt: ModelInput | Sequence[int], num_samples: int, params: SamplingParams
    ) -> SampleResponse:
        tokens = prompt.to_ints() if isinstance(prompt, ModelInput) else list(prompt)
        return (await self.engine.sample_many([tokens], num_samples, params))[0]

    async def sample_many(
        self,
        prompts: Sequence[ModelInput | Sequence[int]],
        num_samples: int,
        params: SamplingParams,
    ) -> list[SampleResponse]:
        """Several prompts in one batched call where the engine supports it."""
        tokens = [p.to_ints() if isinstance(p, ModelInput) else list(p) for p in prompts]
        return await self.engine.sample_many(tokens, num_samples, params)

    async def compute_logprobs(self, prompt: ModelInput | Sequence[int]) -> list[float | None]:
        model_input = prompt if isinstance(prompt, ModelInput) else ModelInput.from_ints(prompt)
        return await self._client.compute_logprobs(model_input)
